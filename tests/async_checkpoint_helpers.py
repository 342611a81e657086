"""save_state(async_save=True) scenarios, run on 1 process (tests/unit) and on 2 ranks (tests/multiprocess).

The background write is held (``staging.Deferred.run`` waits for a gate) until training has taken more steps, so
that a staged copy sharing memory with the live parameters or optimizer states would write the later values.
"""
from __future__ import annotations

import errno
import json
import os
import threading
from contextlib import contextmanager
from typing import Any

import torch

from checkpoint_helpers import make_run, train


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def state_after_load(acc: Any, model: Any, opt: Any, loader: Any, sched: Any, path: str) -> dict[str, Any]:
    """Everything an exact resume restores, read after ``load_state(path)``: parameters, optimizer states, the
    learning rate, the counters, the next random draw and the next batch of the prepared loader."""
    acc.load_state(path)
    inner = acc.unwrap_model(model)
    return {"params": {k: _local(v) for k, v in inner.state_dict().items()},
            "optimizer": [{k: _local(v) for k, v in opt.state[p].items()} for p in inner.parameters()],
            "lr": sched.get_last_lr(), "steps": opt.steps_taken, "accelerator_step": acc.step,
            "next_random": torch.rand(3), "next_batch": [_local(t) for t in next(iter(loader))]}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
    for x, y in zip(a["optimizer"], b["optimizer"], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    for key in ("lr", "steps", "accelerator_step"):
        assert a[key] == b[key], key
    assert torch.equal(a["next_random"], b["next_random"])
    assert all(torch.equal(x, y) for x, y in zip(a["next_batch"], b["next_batch"], strict=True))


@contextmanager
def held_background(fail_with: BaseException | None = None) -> Any:
    """Hold the background write until the yielded gate is set; with ``fail_with``, the write raises it."""
    from impel.checkpoint.saving import staging

    gate = threading.Event()
    real = staging.Deferred.run

    def held(self: Any) -> Any:
        gate.wait(120)
        if fail_with is not None:
            raise fail_with
        return real(self)

    staging.Deferred.run = held  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        staging.Deferred.run = real  # type: ignore[method-assign]


def manifest(path: str) -> dict[str, Any]:
    """The checkpoint's manifest (size and block digests per file), without DCP's .metadata (it names its path)."""
    with open(os.path.join(path, "impel_checkpoint.json"), encoding="utf-8") as fh:
        files = json.load(fh)["files"]
    return {name: entry for name, entry in files.items() if not name.endswith(".metadata")}


def async_equals_sync(root: str, fail_on_rank: int | None = None) -> dict[str, Any]:
    """Save the same state synchronously and asynchronously (training on while the async one is written),
    and report both checkpoints' manifests and loaded states. With ``fail_on_rank``, a second async save's
    background write fails there (disk full) and the next save_state's error is reported."""
    from impel.checkpoint.store import layout

    acc, model, opt, loader, sched = make_run(None)
    train(acc, model, opt, loader, sched, 4)
    acc.save_state(os.path.join(root, "sync"))
    with held_background() as gate:
        returned = acc.save_state(os.path.join(root, "async"), async_save=True)
        train(acc, model, opt, loader, sched, 5)  # parameters and AdamW states change in place before the write
        committed_early = os.path.exists(os.path.join(root, "async"))
        gate.set()
        # ranks wait at different steps: rank 0 now, the others after two more steps, whose collectives on the
        # default group run while their background writes use the save's own group
        waited = acc.wait_for_checkpoint() if acc.process_index == 0 else None
        train(acc, model, opt, loader, sched, 7)
        waited = waited or acc.wait_for_checkpoint()
    out: dict[str, Any] = {"returned": returned, "waited": waited, "committed_early": committed_early,
                           "again": acc.wait_for_checkpoint(), "manifests": [manifest(os.path.join(root, n))
                                                                             for n in ("sync", "async")]}
    if fail_on_rank is not None:
        failure = OSError(errno.ENOSPC, "No space left on device") if acc.process_index == fail_on_rank else None
        with held_background(failure) as gate:
            acc.save_state(os.path.join(root, "failed"), async_save=True)
            train(acc, model, opt, loader, sched, 8)
            gate.set()
            try:
                acc.save_state(os.path.join(root, "next"))
                out["error"] = None
            except layout.CheckpointError as exc:
                out["error"] = str(exc)
        out["failed_listing"] = sorted(os.listdir(root))
        out["retry"] = acc.save_state(os.path.join(root, "next"))  # the error was raised once; saving works again
    out["loaded"] = [state_after_load(acc, model, opt, loader, sched, os.path.join(root, n))
                     for n in ("sync", "async")]
    acc.end_training()
    return out
