"""End torch.distributed's worker threads before the interpreter finalises.

Why this exists (core dump and reasoning: docs/design.md, "Exit teardown"): a gloo process group runs its
collectives on C++ worker threads. A worker releases its finished ``Work`` (and the tensors it holds) only after
the main thread has been woken from ``wait()``. If that release drops the last reference to a tensor that has a
Python object, the worker needs the GIL; once ``Py_FinalizeEx`` has started, CPython (3.10-3.13) ends any thread
that asks for the GIL with ``pthread_exit``, whose forced unwind crosses a ``noexcept`` destructor and the C++
runtime aborts ("terminate called without an active exception", SIGABRT after the job finished). Upstream:
pytorch/pytorch#190489 (open) and the abandoned fix pytorch/pytorch#179291.

``dist.destroy_process_group()`` alone does not help: it only forgets the group; the C++ object, and so its
threads, live on while anything references it, and after an FSDP2 or DDP run the prepared model does (FSDP2's
mesh infos and ``DeviceMesh._pg_registry``, DDP's ``process_group``, ``reducer`` and ``logger``), as do the default
arguments of ``torch.distributed.nn.functional`` and friends, which capture ``group.WORLD`` when they are first
imported after the group exists. :func:`release_process_groups` drops those references at exit, so that the last
reference goes away while the interpreter is fully alive: the group's destructor then waits for its queue and
joins its workers (the binding releases the GIL while it does), and no worker can outlive the interpreter.

This runs only at a normal exit, after the group was destroyed: it reaches into objects the script no longer
uses (a DDP or FSDP2 model cannot communicate after ``end_training()`` anyway).
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import types
import warnings
from typing import Any

import torch.distributed as dist

logger = logging.getLogger("impel")

_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives gloo's worker threads


def release_process_groups() -> None:
    """Drop the references torch objects keep to destroyed process groups, then collect them (joins gloo's
    worker threads). Call only after ``dist.destroy_process_group()`` and only when the script is done."""
    if not dist.is_available():
        return
    with warnings.catch_warnings():  # isinstance() on torch.distributed.reduce_op warns that it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        _clear_captured_default_groups()
        for obj in gc.get_objects():
            try:
                _release_one(obj)
            except Exception as exc:  # noqa: BLE001 - a teardown at exit must never fail a finished run
                logger.debug("could not release the process groups of a %s: %s", type(obj).__name__, exc)
    gc.collect()
    left = gloo_worker_threads()
    if left:
        logger.debug("%d gloo worker threads outlive the process group: something outside impel's prepared "
                     "objects still references a process group (a group the script created and keeps?)", left)


def gloo_worker_threads() -> int:
    """How many gloo worker threads this process has (Linux; 0 where /proc cannot tell)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as fh:
                count += fh.read().strip() == _GLOO_WORKER
        except OSError:  # the thread ended while we looked
            continue
    return count


def _release_one(obj: Any) -> None:
    """One object's process-group references, by type; anything else is left alone."""
    names = {cls.__name__ for cls in type(obj).__mro__}
    if "DeviceMesh" in names and isinstance(getattr(obj, "_pg_registry", None), dict):
        obj._pg_registry.clear()
    elif "DataParallelMeshInfo" in names and hasattr(obj, "__dict__"):  # FSDP2's FSDP/DDP/HSDP mesh infos
        for key, value in vars(obj).items():
            if isinstance(value, dist.ProcessGroup):
                setattr(obj, key, None)
    elif isinstance(obj, _ddp_type()):
        for attr in ("reducer", "logger"):
            if attr in vars(obj):
                delattr(obj, attr)
        obj.process_group = None


def _ddp_type() -> type[Any]:
    module = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(module, "DistributedDataParallel", type(None)) if module else type(None)


def _clear_captured_default_groups() -> None:
    """``def f(..., group=group.WORLD)`` evaluated after the group existed holds it for good: reset to None."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, types.FunctionType):
                _reset_defaults(value)
            elif isinstance(value, type) and value.__module__ == name:
                for member in vars(value).values():
                    if isinstance(member, types.FunctionType):
                        _reset_defaults(member)


def _reset_defaults(fn: types.FunctionType) -> None:
    group = dist.ProcessGroup
    if fn.__defaults__ and any(isinstance(d, group) for d in fn.__defaults__):
        fn.__defaults__ = tuple(None if isinstance(d, group) else d for d in fn.__defaults__)
    if fn.__kwdefaults__ and any(isinstance(d, group) for d in fn.__kwdefaults__.values()):
        fn.__kwdefaults__ = {k: None if isinstance(d, group) else d for k, d in fn.__kwdefaults__.items()}
