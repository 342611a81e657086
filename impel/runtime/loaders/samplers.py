"""Samplers impel's prepared dataloaders use, with Accelerate's names and constructors."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose epoch ``e`` order comes from ``seed + e`` (``use_seedable_sampler=True``): Accelerate's
    draws and constructor (torch's arguments plus ``data_seed``, default torch's initial seed); the generator is
    re-seeded at each pass and a complete pass moves to the next epoch."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed = int(data_seed) if data_seed is not None else torch.random.initial_seed()
        if self.generator is None:
            self.generator = torch.Generator()
        self.epoch = 0

    @classmethod
    def from_sampler(cls, source: RandomSampler, seed: int) -> SeedableRandomSampler:
        """``source`` made seedable (prepare's ``use_seedable_sampler=True``)."""
        return cls(source.data_source, replacement=source.replacement, num_samples=source._num_samples,
                   generator=source.generator, data_seed=seed)

    initial_seed = property(lambda self: self.seed, doc="Accelerate's name for ``seed``.")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)
