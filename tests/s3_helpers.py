"""A real S3 API server (moto in server mode) on localhost, and a training run that saves to it: the script run
by tests/unit/test_checkpoint_s3.py's subprocesses (``python tests/s3_helpers.py MODE PROJECT OUT``)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
SAVE_AT = (4, 8, 12)  # optimizer steps after which the run saves (the second one is killed in "crash" mode)
STEPS = 16


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """A moto S3 server on a free localhost port; yields the environment that points boto3/s3fs at it."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield dict(CREDENTIALS, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    finally:
        server.stop()


class Counter:
    """The optimizer steps taken, saved in the checkpoint (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


def _kill_at_commit(project: str) -> None:
    """SIGKILL this process when the upload reaches the commit object: every other file is uploaded, the commit
    object never is (an upload killed half-way). The checkpoint's filesystem is fsspec's cached instance."""
    from fsspec.core import url_to_fs

    fs, _ = url_to_fs(project)
    put = fs.put_file

    def put_file(lpath: str, rpath: str, *args: Any, **kwargs: Any) -> Any:
        if rpath.endswith("/COMPLETE"):
            os.kill(os.getpid(), signal.SIGKILL)
        return put(lpath, rpath, *args, **kwargs)

    fs.put_file = put_file


def run(mode: str, project: str, out: str) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from impel import Accelerator, ProjectConfiguration

    torch.manual_seed(0)
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2,
                                  automatic_resume=mode == "resume")
    acc = Accelerator(cpu=True, project_config=config)
    data = TensorDataset(torch.randn(STEPS * 4, 6), torch.randn(STEPS * 4, 1))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    model, opt, loader = acc.prepare(model, opt, loader)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x) + 0.01 * torch.randn_like(y), y)  # the RNG state matters too
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        counter.steps += 1
        if counter.steps in SAVE_AT:
            if mode == "crash" and counter.steps == SAVE_AT[1]:
                _kill_at_commit(project)
            acc.save_state(async_save=counter.steps != SAVE_AT[0])  # the first synchronous, the others async
    acc.end_training()
    torch.save({"steps": counter.steps, "weights": acc.unwrap_model(model).state_dict()}, out)


def ranks_save(project: str, steps: int, save_at: list[int]) -> dict[str, Any]:
    """On every rank (run_on_ranks): train ``steps`` optimizer steps with asynchronous saves to ``project`` (a URL)
    at ``save_at`` (total_limit=1); the final state (saving changes nothing: the uninterrupted run)."""
    from checkpoint_helpers import make_run, snapshot, train

    acc, model, opt, loader, sched = make_run(project, total_limit=1)
    acc.project_configuration.async_save = True
    train(acc, model, opt, loader, sched, steps, save_at)
    acc.end_training()  # the last upload is committed
    return snapshot(acc, model, opt, sched)


def ranks_resume(project: str, steps: int) -> dict[str, Any]:
    """On every rank: a differently seeded job that loads the newest committed checkpoint and trains to ``steps``."""
    from checkpoint_helpers import make_run, snapshot, train

    acc, model, opt, loader, sched = make_run(project, seed=1234, total_limit=1)
    loaded = acc.load_state()
    train(acc, model, opt, loader, sched, steps)
    return dict(snapshot(acc, model, opt, sched), loaded=loaded)


if __name__ == "__main__":
    run(*sys.argv[1:4])
