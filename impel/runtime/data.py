"""Preparing a DataLoader: :func:`shard_dataloader` rebuilds the user's loader over this rank's shard
(:mod:`impel.runtime.shard_layout`) behind a :class:`DataLoaderShard` (:mod:`impel.runtime.prepared_loader`), with
the order agreed across ranks; :func:`skip_first_batches` starts a pass some batches in.

The shard kinds and the prepared loader are importable from here too (their earlier home).
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from impel.config.plugins import DataLoaderConfiguration
from impel.config.run_config import ConfigError
from impel.runtime import collectives
from impel.runtime.dispatch import dispatching_loader
from impel.runtime.prepared_loader import DataLoaderShard as DataLoaderShard  # re-exported: its earlier home
from impel.runtime.samplers import SeedableRandomSampler as SeedableRandomSampler  # re-exported: Accelerate's path
from impel.runtime.shard_layout import BatchShardSampler as BatchShardSampler
from impel.runtime.shard_layout import IterableShard as IterableShard
from impel.runtime.shard_layout import ShardSampler as ShardSampler


def _check_loader(loader: DataLoader) -> None:
    if any(isinstance(s, DistributedSampler) for s in (loader.sampler, getattr(loader, "batch_sampler", None))):
        raise ConfigError("the DataLoader already uses a DistributedSampler; impel shards data itself, so build "
                          "the DataLoader with shuffle=True/False instead of a DistributedSampler")
    if loader.batch_size is None and loader.batch_sampler is None and not isinstance(loader.sampler, BatchSampler):
        raise ConfigError("DataLoader(batch_size=None) (no automatic batching) cannot be sharded unless its sampler "
                          "is a BatchSampler; give it a batch_size, a batch_sampler or sampler=BatchSampler(...)")


def _agree_on_generator(sampler: Any) -> None:
    """Give ``sampler`` rank 0's generator, so every rank draws the same order (several ranks, map-style).

    As in Accelerate: a sampler with a ``generator`` attribute left at None gets a new generator seeded from one
    draw of torch's global RNG; an existing generator takes rank 0's state.
    """
    if not hasattr(sampler, "generator"):
        return
    if sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(int(collectives.broadcast(seed, from_process=0)))
    elif isinstance(sampler.generator, torch.Generator):
        sampler.generator.set_state(collectives.broadcast(sampler.generator.get_state(), from_process=0))


def _order_sampler(sampler: Any, world: int, config: DataLoaderConfiguration, share_generator: bool) -> Any:
    """The sampler that orders one epoch's indices: the user's, made seedable or agreed across ranks."""
    if isinstance(sampler, RandomSampler) and config.use_seedable_sampler:
        seed = config.data_seed if config.data_seed is not None else torch.initial_seed()
        return SeedableRandomSampler.from_sampler(sampler, int(collectives.broadcast(int(seed), from_process=0)))
    if world > 1 and share_generator:
        _agree_on_generator(sampler)
    return sampler


def shard_dataloader(loader: DataLoader, *, world: int, rank: int, device: torch.device | None,
                     config: DataLoaderConfiguration, gradient_state: Any,
                     rng_types: list[str] | None = None, hooks: Any = None,
                     slice_fn: Callable[..., Any] | None = None) -> DataLoaderShard:
    """Rebuild ``loader`` so this rank reads its shard; the result iterates like the original.

    ``slice_fn`` (Accelerate's ``slice_fn_for_dispatch``) cuts each rank's part of a dispatched global batch; it
    needs ``config.dispatch_batches``.

    ``rng_types`` (Accelerate's, default ``["generator"]``): with "generator" the order sampler's generator is
    rank 0's; "torch" / "cuda" are shared from rank 0 at the start of every pass.
    """
    rng_types = ["generator"] if rng_types is None else rng_types
    _check_loader(loader)
    per_rank = loader.batch_size or 0
    if config.split_batches and loader.batch_size is not None:
        if loader.batch_size % world:
            raise ConfigError(f"split_batches=True needs the DataLoader batch_size ({loader.batch_size}) to be a "
                              f"multiple of the number of processes ({world}); change one of them")
        per_rank = loader.batch_size // world
    extra: dict[str, Any] = {"collate_fn": loader.collate_fn, "num_workers": loader.num_workers,
                             "pin_memory": loader.pin_memory, "timeout": loader.timeout,
                             "worker_init_fn": loader.worker_init_fn, "generator": loader.generator,
                             "persistent_workers": loader.persistent_workers,
                             "multiprocessing_context": loader.multiprocessing_context}
    if loader.num_workers > 0:
        extra["prefetch_factor"] = loader.prefetch_factor
    if config.dispatch_batches:  # rank 0 reads, every rank receives its slice (impel.runtime.dispatch)
        shard: Any = dispatching_loader(loader, extra, world=world, rank=rank, split_batches=config.split_batches,
                                        device=device, seedable=config.use_seedable_sampler, slice_fn=slice_fn)
        return DataLoaderShard(shard, shard, device, config.non_blocking, gradient_state, per_rank, loader, rng_types,
                               hooks)
    if slice_fn is not None:
        raise ConfigError("slice_fn_for_dispatch only cuts dispatched batches (rank 0 reads, every rank receives its "
                          "slice), and this DataLoader is not dispatched: pass dispatch_batches=True "
                          "(DataLoaderConfiguration) or leave slice_fn_for_dispatch None")
    if isinstance(loader.dataset, IterableDataset):
        if loader.num_workers > 0:
            raise ConfigError(f"DataLoader(num_workers={loader.num_workers}) over an IterableDataset: impel shards "
                              "iterable datasets in the main process; use num_workers=0 or a map-style dataset")
        shard = IterableShard(loader.dataset, per_rank, world, rank, loader.drop_last, config.even_batches)
        new = DataLoader(shard, batch_size=per_rank, drop_last=loader.drop_last, **extra)
    elif loader.batch_sampler is None:  # sampler=BatchSampler(...), batch_size=None: one fetch per index batch
        if config.split_batches:
            raise ConfigError("split_batches=True needs a DataLoader with batch_size, not sampler=BatchSampler(...)")
        batches: Any = loader.sampler
        if getattr(batches, "sampler", None) is not None:
            batches.sampler = _order_sampler(batches.sampler, world, config, "generator" in rng_types)
        shard = BatchShardSampler(batches, world, rank, config.even_batches)
        new = DataLoader(loader.dataset, sampler=shard, batch_size=None, **extra)
    elif loader.batch_size is None:  # the user's own batch_sampler
        if config.split_batches:
            raise ConfigError("split_batches=True needs a DataLoader with batch_size, not a custom batch_sampler")
        batch_sampler: Any = loader.batch_sampler  # any iterable of index lists; may hold a ``sampler``
        inner = getattr(batch_sampler, "sampler", None)
        if inner is not None:
            batch_sampler.sampler = _order_sampler(inner, world, config, "generator" in rng_types)
        shard = BatchShardSampler(loader.batch_sampler, world, rank, config.even_batches)
        new = DataLoader(loader.dataset, batch_sampler=shard, **extra)
    else:
        sampler = _order_sampler(loader.sampler, world, config, "generator" in rng_types)
        shard = ShardSampler(sampler, per_rank, world, rank, loader.drop_last, config.even_batches)
        new = DataLoader(loader.dataset, batch_sampler=shard, **extra)
    return DataLoaderShard(new, shard, device, config.non_blocking, gradient_state, per_rank, loader, rng_types, hooks)


class _SkipBatchSampler(Sampler[list[int]]):
    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip_count = batch_sampler, skip

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_count)

    def __iter__(self) -> Iterator[list[int]]:
        yield from itertools.islice(self.batch_sampler, self.skip_count, None)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A dataloader whose next pass starts ``num_batches`` batches in (the skipped ones are not loaded)."""
    if isinstance(dataloader, DataLoaderShard):
        clone = copy.copy(dataloader)
        clone.skip_batches(num_batches)
        dataloader._skip_next = 0  # the view runs the next pass: a skip load_state left pending is not repeated
        return clone
    if isinstance(dataloader, DataLoader) and not isinstance(dataloader.dataset, IterableDataset):
        return DataLoader(dataloader.dataset, batch_sampler=_SkipBatchSampler(dataloader.batch_sampler, num_batches),
                          collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                          pin_memory=dataloader.pin_memory)
    raise ConfigError(f"skip_first_batches got {type(dataloader).__name__}; pass a prepared or map-style DataLoader")
