"""Seeding: one call seeds python, numpy, torch and CUDA."""
from __future__ import annotations

import random

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
        from .env import read_topology

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
