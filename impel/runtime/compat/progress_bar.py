"""Accelerate's ``tqdm``: a progress bar drawn on one process per machine instead of one per rank.

Example::

    for batch in tqdm(loader, desc="train"):          # drawn by local rank 0 only
        ...
    for batch in tqdm(loader, main_process_only=False):  # drawn by every rank
        ...
"""
from __future__ import annotations

from typing import Any


def tqdm(*args: object, main_process_only: bool = True, **kwargs: object) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but local rank 0 unless
    ``main_process_only=False`` (an explicit ``disable=True`` always wins)."""
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError:
        raise ImportError("impel's tqdm needs the tqdm package: pip install tqdm") from None
    if args and isinstance(args[0], bool):
        raise ValueError(f"tqdm({args[0]!r}, ...): a bool as the first argument is Accelerate's old signature; pass "
                         f"main_process_only={args[0]!r} as a keyword")
    from impel.runtime.ranks.process import current_topology

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = current_topology().local_rank != 0
    return _tqdm(*args, disable=disable, **kwargs)
