"""Device memory helpers with Accelerate's names: retry a function at smaller batch sizes on out-of-memory, and
release objects' memory.

Example::

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size):
        ...                      # raises torch.OutOfMemoryError at 128 -> retried at 115, 103, ...

    train()
"""
from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

_OOM_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN refuses the (too large) problem
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached allocator blocks of every visible accelerator to the driver (after ``gc.collect()``)."""
    if garbage_collection:
        gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        mps.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()


def release_memory(*objects: object) -> list[None]:
    """Drop the references passed in, collect garbage and empty device caches; returns ``[None] * len(objects)``
    to assign back (``a, b = release_memory(a, b)``)."""
    count = len(objects)
    del objects  # the caller's names still hold them until it assigns the returned Nones
    clear_device_cache(garbage_collection=True)
    return [None] * count


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when ``exception`` is an out-of-memory (CUDA, MPS, XPU, CPU, HPU) or cuDNN "not supported" error."""
    import torch

    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(message in exception.args[0] for message in _OOM_MESSAGES)
    return False


def find_executable_batch_size(function: Callable[..., object] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Any:
    """Decorator: call ``function(batch_size, *args, **kwargs)`` and, on an out-of-memory error, retry with a
    smaller batch size (``int(batch_size * 0.9)``, as Accelerate 1.15, or ``reduce_batch_size_fn()``) until it
    runs; raises RuntimeError when the size reaches 0 (at the call, as Accelerate: also for
    ``starting_batch_size=0``). Other errors propagate at once."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int) or starting_batch_size < 0:
        raise ValueError(f"find_executable_batch_size(starting_batch_size={starting_batch_size!r}) must be an "
                         "integer >= 1 (0 raises at the call, as Accelerate's)")
    batch_size = starting_batch_size

    def shrink() -> int:
        return int(batch_size * 0.9)

    next_size = reduce_batch_size_fn or shrink

    @functools.wraps(function)
    def decorator(*args: object, **kwargs: object) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{name}={value!r}" for name, value in zip(params[1:], args[1:]))
            raise TypeError(f"{function.__name__} got the batch size as its first argument, but the decorator "
                            f"passes it; call {function.__name__}({given}) instead")
        while True:
            if batch_size <= 0:
                raise RuntimeError(f"No executable batch size found, reached zero. ({function.__name__}: out of "
                                   f"memory down to batch size 1, or starting_batch_size={starting_batch_size}); "
                                   "reduce the model or sequence size, or use more devices")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried
                if not should_reduce_batch_size(exc):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = next_size()

    return decorator


def trim_host_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    A checkpoint briefly holds staged state and I/O buffers in the threads that write and hash it; glibc keeps
    what they free in per-thread arenas, so a long run with periodic saves creeps up in RSS without leaking.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ldconfig: ~5 ms, every save otherwise)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
