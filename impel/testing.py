"""Run a function on N CPU ranks over gloo: for impel's own tests and for users' tests.

Each rank is a fresh process, forked from a server that preloaded torch, with torchrun's variables set
(127.0.0.1, OMP_NUM_THREADS=1) and the caller's environment as it is at the call.
The whole job is bounded by ``timeout``: a dead or hung rank fails the call instead of hanging the test run, and a
hung rank's Python stack (or a crashed one's: faulthandler, SIGSEGV / SIGABRT) comes back in the error.

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
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext
    from multiprocessing.process import BaseProcess

    import torch.distributed as dist

GRACE_AFTER_FAILURE_S = 20.0  # the other ranks' time to fail or finish after one rank failed
JOIN_TIMEOUT_S = 600.0  # a finished rank waits this long at most for its peers to finish (the job's timeout is less)
_DONE_KEY = "impel-testing/finished"
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX: ask a hung rank for its Python stack


def free_port() -> int:
    """A port that was free a moment ago. Racy: another process can take it before you bind it, so retry on
    ``EADDRINUSE`` (``run_on_ranks`` does not use it: its rendezvous store binds port 0 itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out; the message carries its traceback."""


def _child(fn: Callable[..., object], args: Sequence[object], kwargs: Mapping[str, object], rank: int,
           environ: dict[str, str], out_dir: str) -> None:
    # The forkserver's own environment is the one it was started with (the first job of this process); the
    # caller's environment of *this* call replaces it, so a later os.environ change (monkeypatch.setenv) arrives.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    path = Path(out_dir) / f"rank{rank}.pkl"
    if _STACK_SIGNAL is not None:
        import faulthandler

        stack_file = open(Path(out_dir) / f"rank{rank}.stack", "w")  # noqa: SIM115 - open until the process ends
        faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=True)
        faulthandler.enable(file=stack_file, all_threads=True)  # a native crash (SIGSEGV, SIGABRT) writes it too
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
    _join_peers(environ, finished=bool(payload["ok"]))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass


def _join_peers(environ: dict[str, str], finished: bool) -> None:
    """Leave only when every rank has finished ``fn``: a rank that exits while a peer is still inside a collective
    or a handshake closes its sockets under that peer, which then fails with a misleading "Connection closed by
    peer". Over the job's store, not the process group (the function may have made or destroyed its own). A rank
    that raised only checks in and leaves, so that peers blocked on it fail now rather than at the timeout."""
    world_size = int(environ["WORLD_SIZE"])
    if world_size == 1:
        return
    import torch.distributed as dist

    try:
        store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), None, False,
                              timeout=timedelta(seconds=GRACE_AFTER_FAILURE_S))
        store.add(_DONE_KEY, 1)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while finished and store.add(_DONE_KEY, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the parent reports a missing rank; this wait is only a courtesy to peers
        pass


def _context() -> SpawnContext | ForkServerContext:
    """A forkserver that has imported torch once: each rank then starts in milliseconds instead of seconds.

    Falls back to ``spawn`` where forkserver does not exist (Windows, macOS default builds still have it).
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # DDP's constructor imports torch._dynamo (seconds); DCP's state_dict helpers are used by every checkpoint;
    # transformers' model base and its GPT-2 / Llama (what tiny test models are built from) cost each rank ~1.7 s
    # of CPU to import. A module that is not installed is skipped by the forkserver.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "torch.distributed.checkpoint.state_dict", "impel.accelerator.facade",
                                "transformers.modeling_utils", "transformers.models.gpt2.modeling_gpt2",
                                "transformers.models.llama.modeling_llama"])
    return ctx


def _rendezvous_store(world_size: int) -> dist.TCPStore | None:
    """The job's TCPStore, hosted here on a port the OS picks while binding it (no free-port race), as torchrun's
    agent hosts it: the ranks connect as clients (``TORCHELASTIC_USE_AGENT_STORE``). None for one rank."""
    if world_size == 1:
        return None
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def _wait(procs: Sequence[BaseProcess], timeout: float) -> str:
    """Until every rank has exited; else why the ranks still running are stopped."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline:
            return f"timed out after {timeout:.0f}s"
        if failed_at is not None and now - failed_at > GRACE_AFTER_FAILURE_S:
            return f"was still running {GRACE_AFTER_FAILURE_S:.0f}s after another rank failed"
        time.sleep(0.05)
    return ""


def _stacks_of(procs: Sequence[BaseProcess], out_dir: str) -> dict[int, str]:
    """Ask the ranks still running for their Python stacks (faulthandler), then kill them."""
    alive = {r: p for r, p in enumerate(procs) if p.is_alive()}
    if alive and _STACK_SIGNAL is not None:
        for pid in (p.pid for p in alive.values() if p.pid is not None):  # a started process has one
            try:
                os.kill(pid, _STACK_SIGNAL)
            except ProcessLookupError:  # it exited meanwhile
                pass
        time.sleep(1.0)
    stacks = {}
    for r in alive:
        path = Path(out_dir) / f"rank{r}.stack"
        stacks[r] = path.read_text(errors="replace")[-4000:] if path.exists() else ""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    return stacks


def run_on_ranks(fn: Callable[..., object], world_size: int = 2, args: Sequence[object] = (),
                 kwargs: Mapping[str, object] | None = None, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result, in rank order.

    ``env``: variables set on the ranks on top of this process's environment. Keep ``timeout`` below the test
    runner's own limit (pytest-timeout), so that a hang reports the ranks' stacks rather than the runner's.
    """
    ctx = _context()
    store = _rendezvous_store(world_size)
    environ = dict(os.environ)
    environ.update({"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port if store is not None else 0), "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_USE_AGENT_STORE": str(store is not None), "OMP_NUM_THREADS": "1"})
    environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory(prefix="impel-ranks-") as out_dir:
            procs = [ctx.Process(target=_child, args=(fn, tuple(args), kwargs or {}, r, environ, out_dir),
                                 daemon=True) for r in range(world_size)]
            for p in procs:
                p.start()
            why = _wait(procs, timeout)
            stacks = _stacks_of(procs, out_dir)
            return _collect(procs, out_dir, stacks, why, timeout)
    finally:
        del store  # the last reference: its server stops


def _collect(procs: Sequence[BaseProcess], out_dir: str, stacks: dict[int, str], why: str, timeout: float) -> list[Any]:
    results: list[Any] = []
    errors: list[str] = []
    for r, p in enumerate(procs):
        path = Path(out_dir) / f"rank{r}.pkl"
        if not path.exists():
            if r in stacks:
                errors.append(f"rank {r} {why}; its Python stack:\n{stacks[r] or '(not available)'}")
            else:
                crash = Path(out_dir) / f"rank{r}.stack"
                stack = crash.read_text(errors="replace")[-4000:] if crash.exists() else ""
                errors.append(f"rank {r} exited with code {p.exitcode} without a result"
                              + (f"; its Python stack when it crashed:\n{stack}" if stack else ""))
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
        raise RankFailed(f"{len(errors)} of {len(procs)} ranks failed (timeout {timeout:.0f}s):\n" + "\n".join(errors))
    return results
