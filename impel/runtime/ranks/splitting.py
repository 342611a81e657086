"""split_between_processes: each rank's contiguous share of a list, tuple, dict of sequences or tensor."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeGuard, TypeVar

import torch

from impel.config.run_config import ConfigError

D = TypeVar("D", bound="Selectable")


class Selectable(Protocol):
    """A ``datasets.Dataset`` as splitting uses it: its length and ``select`` (the rows, in a dataset of its type)."""

    def __len__(self) -> int: ...
    def select(self: D, indices: list[int]) -> D: ...


def _bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def split_for_rank(inputs: object, world: int, rank: int, apply_padding: bool = False) -> Any:
    """Contiguous shares, the first ``n % world`` ranks getting one more; ``apply_padding`` repeats the last
    element so every rank gets the same count (useful before a gather)."""
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ConfigError(f"split_between_processes got a dict whose values have different lengths {lengths}; "
                              "give every value the same length")
        rebuild: Callable[..., object] = type(inputs)  # the concrete mapping class (dict, BatchEncoding, ...)
        return rebuild({k: split_for_rank(v, world, rank, apply_padding) for k, v in inputs.items()})
    if _is_hf_dataset(inputs):
        return _split_dataset(inputs, world, rank, apply_padding)
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise ConfigError(f"split_between_processes got {type(inputs).__name__}; pass a list, tuple, dict, tensor "
                          "or datasets.Dataset")
    n = len(inputs)
    start, end = _bounds(n, world, rank)
    part = inputs[start:end]
    if apply_padding and n:
        want = -(-n // world)
        missing = want - len(part)
        if missing:
            if isinstance(inputs, torch.Tensor):
                part = torch.cat([inputs[start:end]] + [inputs[-1:]] * missing)
            else:
                part = type(inputs)(list(part) + list(inputs[-1:]) * missing)
    return part


def _is_hf_dataset(inputs: object) -> TypeGuard[Selectable]:
    datasets = sys.modules.get("datasets")  # a Dataset exists only once the package is imported
    return datasets is not None and isinstance(inputs, datasets.Dataset)


def _split_dataset(inputs: D, world: int, rank: int, apply_padding: bool) -> D:
    """This rank's rows of a ``datasets.Dataset`` (``select``); padding repeats the last row."""
    n = len(inputs)
    start, end = _bounds(n, world, rank)
    rows = list(range(start, end))
    if apply_padding and n:
        rows += [n - 1] * (-(-n // world) - len(rows))
    return inputs.select(rows)
