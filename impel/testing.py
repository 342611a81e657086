"""Run a function on N CPU ranks over gloo: for impel's own tests and for users' tests.

Each rank is a fresh process, forked from a server that preloaded torch, with torchrun's variables set
(127.0.0.1, a free port, OMP_NUM_THREADS=1).
The whole job is bounded by ``timeout``: a dead or hung rank fails the call instead of hanging the test run.

Example::

    def work(scale):
        acc = Accelerator(cpu=True)
        return acc.gather(torch.tensor([acc.process_index * scale]))

    results = run_on_ranks(work, 2, args=(3,))   # [tensor([0, 3]), tensor([0, 3])]
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out; the message carries its traceback."""


def _child(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], rank: int, world: int, port: int,
           out_dir: str, extra_env: dict[str, str]) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", **extra_env})
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(*args, **kwargs)
        payload = {"ok": True, "result": result}
    except BaseException:  # noqa: BLE001 - the parent reports it
        payload = {"ok": False, "error": traceback.format_exc()}
    with open(path.with_suffix(".tmp"), "wb") as f:
        pickle.dump(payload, f)
    os.replace(path.with_suffix(".tmp"), path)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass


def _context() -> Any:
    """A forkserver that has imported torch once: each rank then starts in milliseconds instead of seconds.

    Falls back to ``spawn`` where forkserver does not exist (Windows, macOS default builds still have it).
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # DDP's constructor imports torch._dynamo (seconds); DCP's state_dict helpers are used by every checkpoint
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "torch.distributed.checkpoint.state_dict", "impel.accelerator"])
    return ctx


def run_on_ranks(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
                 kwargs: dict[str, Any] | None = None, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result, in rank order."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="impel-ranks-") as out_dir:
        procs = [ctx.Process(target=_child, args=(fn, tuple(args), kwargs or {}, r, world_size, port, out_dir,
                                                  dict(env or {})), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if any(p.exitcode not in (None, 0) for p in procs) and failed_at is None:
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 20):
                break
            time.sleep(0.05)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        results: list[Any] = []
        errors: list[str] = []
        for r, p in enumerate(procs):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                why = "timed out" if r in alive else f"exited with code {p.exitcode} without a result"
                errors.append(f"rank {r} {why}")
                results.append(None)
                continue
            with open(path, "rb") as f:
                payload = pickle.load(f)
            if payload["ok"]:
                results.append(payload["result"])
            else:
                errors.append(f"rank {r} raised:\n{payload['error']}")
                results.append(None)
        if errors:
            raise RankFailed(f"{len(errors)} of {world_size} ranks failed (timeout {timeout:.0f}s):\n" + "\n".join(errors))
        return results
