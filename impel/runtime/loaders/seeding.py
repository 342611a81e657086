"""Seeding: one call seeds python, numpy, torch and CUDA; rank 0's generator states shared with every rank."""
from __future__ import annotations

import enum
import random
from collections.abc import Iterable
from typing import Any

import torch


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> int:
    """Seed every RNG impel and the user touch; returns the seed used.

    ``device_specific=True`` adds the process index, so ranks draw different dropout masks and augmentations
    while the data order (seeded separately by prepared dataloaders from rank 0's seed) stays shared.

    Example::

        set_seed(42)
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed(seed={seed!r}) needs an integer")
    if device_specific:
        from impel.config.environment import read_topology

        seed += read_topology().rank
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return seed


class RNGType(str, enum.Enum):
    """Accelerate's random-number generators; impel synchronises ``torch``, ``cuda`` and ``generator``."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"

    def __str__(self) -> str:
        return self.value


def _rng_accessors(kind: RNGType, generator: torch.Generator | None) -> tuple[Any, Any]:
    """(get_state, set_state) for one generator kind; raises for kinds impel does not drive."""
    if kind is RNGType.TORCH:
        return torch.get_rng_state, torch.set_rng_state
    if kind is RNGType.CUDA:
        if not torch.cuda.is_available():
            raise RuntimeError("synchronize_rng_state('cuda') needs a CUDA device; none is visible here")
        return torch.cuda.get_rng_state, torch.cuda.set_rng_state
    if kind is RNGType.GENERATOR:
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs generator=<the torch.Generator to share>")
        return generator.get_state, generator.set_state
    raise ValueError(f"rng_type={kind.value!r} belongs to hardware impel does not drive; use 'torch', 'cuda' or "
                     "'generator'")


def synchronize_rng_state(rng_type: str | RNGType | None = None, generator: torch.Generator | None = None) -> None:
    """Give every rank rank 0's state of one generator (a no-op in a single process).

    Example::

        synchronize_rng_state("torch")   # dropout masks now agree across ranks
    """
    import torch.distributed as dist

    from impel.runtime.ranks.collectives import is_distributed

    if rng_type is None:  # Accelerate's default, which fails there (UnboundLocalError)
        raise ValueError("synchronize_rng_state() needs rng_type: one of 'torch', 'cuda' or 'generator' (with "
                         "generator=...)")
    get_state, set_state = _rng_accessors(RNGType(rng_type), generator)
    state = get_state()
    if not is_distributed():
        return
    if dist.get_backend() == "nccl":  # nccl only moves CUDA tensors
        state = state.to(torch.device("cuda", torch.cuda.current_device()))
    dist.broadcast(state, src=0)
    set_state(state.cpu())


def synchronize_rng_states(rng_types: Iterable[str | RNGType], generator: torch.Generator | None = None) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types`` (e.g. ``["torch", "generator"]``)."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator)


def check_rng_types(rng_types: Iterable[str | RNGType] | None) -> list[str]:
    """``Accelerator(rng_types=...)`` validated: the generators prepared dataloaders share from rank 0 at each pass.

    None means Accelerate's default, ``["generator"]`` (the sampler's generator only).
    """
    if rng_types is None:
        return [RNGType.GENERATOR.value]
    if isinstance(rng_types, (str, RNGType)):
        raise ValueError(f"rng_types={rng_types!r} must be a list, e.g. rng_types=[{str(rng_types)!r}]")
    kinds = []
    for value in rng_types:
        try:
            kind = RNGType(value)
        except ValueError:
            raise ValueError(f"rng_types entry {value!r} is not a generator kind; use 'torch', 'cuda' or "
                             "'generator'") from None
        _rng_accessors(kind, torch.Generator())  # raises for kinds impel does not drive
        kinds.append(kind.value)
    return kinds
