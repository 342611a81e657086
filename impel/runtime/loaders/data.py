"""Preparing a DataLoader: :func:`shard_dataloader` rebuilds the user's loader over this rank's shard
(:mod:`impel.runtime.loaders.shard_layout`), with the order agreed across ranks, behind Accelerate's two prepared kinds:
:class:`DataLoaderShard` (each rank reads its shard) or, with ``dispatch_batches``, :class:`DataLoaderDispatcher`
(rank 0 reads, :mod:`impel.runtime.loaders.dispatch`). Both are ``PreparedLoader`` subclasses
(:mod:`impel.runtime.loaders.prepared_loader`) and take Accelerate's constructors when built directly.
:func:`skip_first_batches` starts a pass some batches in.

The shard kinds are importable from here too (their earlier home).
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
from impel.runtime.loaders.dispatch import dispatching_loader
from impel.runtime.loaders.prepared_loader import PreparedLoader
from impel.runtime.loaders.samplers import (
    SeedableRandomSampler as SeedableRandomSampler,  # re-exported: Accelerate's path
)
from impel.runtime.loaders.shard_layout import BatchShardSampler as BatchShardSampler
from impel.runtime.loaders.shard_layout import ItemShard
from impel.runtime.loaders.shard_layout import IterableShard as IterableShard
from impel.runtime.loaders.shard_layout import ShardSampler as ShardSampler
from impel.runtime.ranks import collectives
from impel.runtime.ranks.process import PartialState
from impel.runtime.step.accumulation import GradientState


def _check_loader(loader: DataLoader, config: DataLoaderConfiguration) -> None:
    if any(isinstance(s, DistributedSampler) for s in (loader.sampler, getattr(loader, "batch_sampler", None))):
        raise ConfigError("the DataLoader already uses a DistributedSampler; impel shards data itself, so build "
                          "the DataLoader with shuffle=True/False instead of a DistributedSampler")
    if _unbatched(loader) and (config.dispatch_batches or config.split_batches):
        raise ConfigError("DataLoader(batch_size=None) (no automatic batching) yields single samples, which "
                          f"{'dispatch_batches' if config.dispatch_batches else 'split_batches'}=True cannot cut into "
                          "per-rank parts; give the DataLoader a batch_size, or drop that option")


def _dispatch_by_default(loader: DataLoader, world: int, device: torch.device | None,
                         config: DataLoaderConfiguration) -> bool:
    """``dispatch_batches=None``: an iterable dataset is dispatched from rank 0, as Accelerate's default (its ranks
    may yield different lengths, or different data: rank 0's stream is the one read, and every rank stops together).
    Read per rank where dispatching changes nothing (one process) or cannot run: no device placement,
    ``use_seedable_sampler``, tensor / context parallel ranks, or no automatic batching."""
    import torch.distributed as dist

    return (isinstance(loader.dataset, IterableDataset) and world > 1 and device is not None
            and not config.use_seedable_sampler and not _unbatched(loader)
            and not (dist.is_initialized() and world != dist.get_world_size()))


def _unbatched(loader: DataLoader) -> bool:
    """No automatic batching and no BatchSampler as the sampler: each item is one sample."""
    return loader.batch_size is None and loader.batch_sampler is None and not isinstance(loader.sampler, BatchSampler)


def agree_on_generator(sampler: object) -> None:
    """Give ``sampler`` rank 0's generator, so every rank draws the same order (several ranks, map-style; an
    elastic job's rank alone too, so that its order is the one of several).

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


def _order_sampler(sampler: object, world: int, config: DataLoaderConfiguration, share_generator: bool) -> Any:
    """The sampler that orders one epoch's indices: the user's, made seedable or agreed across ranks."""
    if isinstance(sampler, RandomSampler) and config.use_seedable_sampler:
        seed = config.data_seed if config.data_seed is not None else torch.initial_seed()
        return SeedableRandomSampler.from_sampler(sampler, int(collectives.broadcast(int(seed), from_process=0)))
    if world > 1 and share_generator:
        agree_on_generator(sampler)
    return sampler


def _reorder(batch_sampler: Any, world: int, config: DataLoaderConfiguration, share_generator: bool) -> None:
    """The ``sampler`` a batch sampler holds, if any, made seedable or agreed across ranks (set only if replaced:
    a ``BatchSamplerShard``'s ``sampler`` reads through)."""
    inner = getattr(batch_sampler, "sampler", None)
    if inner is not None:
        ordered = _order_sampler(inner, world, config, share_generator)
        if ordered is not inner:
            batch_sampler.sampler = ordered


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The user's DataLoader settings the rebuilt loader keeps (all but the sampling)."""
    extra: dict[str, Any] = {"collate_fn": loader.collate_fn, "num_workers": loader.num_workers,
                             "pin_memory": loader.pin_memory, "timeout": loader.timeout,
                             "worker_init_fn": loader.worker_init_fn, "generator": loader.generator,
                             "persistent_workers": loader.persistent_workers,
                             "multiprocessing_context": loader.multiprocessing_context}
    if loader.num_workers > 0:
        extra["prefetch_factor"] = loader.prefetch_factor
    return extra


def _per_rank_batch(loader: DataLoader, world: int, config: DataLoaderConfiguration) -> int:
    if _unbatched(loader):
        return 1  # one sample per rank per step
    if config.split_batches and loader.batch_size is not None:
        if loader.batch_size % world:
            raise ConfigError(f"split_batches=True needs the DataLoader batch_size ({loader.batch_size}) to be a "
                              f"multiple of the number of processes ({world}); change one of them")
        return loader.batch_size // world
    return loader.batch_size or 0


def _rebuild(loader: DataLoader, world: int, rank: int, per_rank: int, config: DataLoaderConfiguration,
             share_generator: bool) -> tuple[DataLoader, Any]:
    """The loader over this rank's shard, and the shard (each rank reads its own)."""
    extra = _loader_kwargs(loader)
    if isinstance(loader.dataset, IterableDataset):
        if loader.num_workers > 0:
            raise ConfigError(f"DataLoader(num_workers={loader.num_workers}) over an IterableDataset: impel shards "
                              "iterable datasets in the main process; use num_workers=0 or a map-style dataset")
        shard: Any = IterableShard(loader.dataset, per_rank, world, rank, loader.drop_last, config.even_batches)
        return DataLoader(shard, batch_size=loader.batch_size and per_rank, drop_last=loader.drop_last, **extra), shard
    if _unbatched(loader):  # DataLoader(batch_size=None) over a map-style dataset: one index per fetch
        shard = ItemShard(_order_sampler(loader.sampler, world, config, share_generator), world, rank,
                          config.even_batches)
        return DataLoader(loader.dataset, sampler=shard, batch_size=None, **extra), shard
    if loader.batch_sampler is None:  # sampler=BatchSampler(...), batch_size=None: one fetch per index batch
        if config.split_batches:
            raise ConfigError("split_batches=True needs a DataLoader with batch_size, not sampler=BatchSampler(...)")
        batches: Any = loader.sampler
        _reorder(batches, world, config, share_generator)
        shard = BatchShardSampler(batches, world, rank, config.even_batches)
        return DataLoader(loader.dataset, sampler=shard, batch_size=None, **extra), shard
    if loader.batch_size is None:  # the user's own batch_sampler
        if config.split_batches:
            raise ConfigError("split_batches=True needs a DataLoader with batch_size, not a custom batch_sampler")
        _reorder(loader.batch_sampler, world, config, share_generator)  # any iterable of index lists
        shard = BatchShardSampler(loader.batch_sampler, world, rank, config.even_batches)
        return DataLoader(loader.dataset, batch_sampler=shard, **extra), shard
    sampler = _order_sampler(loader.sampler, world, config, share_generator)
    shard = ShardSampler(sampler, per_rank, world, rank, loader.drop_last, config.even_batches)
    return DataLoader(loader.dataset, batch_sampler=shard, **extra), shard


def shard_dataloader(loader: DataLoader, *, world: int, rank: int, device: torch.device | None,
                     config: DataLoaderConfiguration, gradient_state: object,
                     rng_types: list[str] | None = None, hooks: object = None,
                     slice_fn: Callable[..., object] | None = None) -> PreparedLoader:
    """Rebuild ``loader`` so this rank reads its shard; the result iterates like the original.

    A :class:`DataLoaderShard`, or with ``config.dispatch_batches`` a :class:`DataLoaderDispatcher`. ``slice_fn``
    (Accelerate's ``slice_fn_for_dispatch``) cuts each rank's part of a dispatched global batch; it needs
    ``config.dispatch_batches``.

    ``rng_types`` (Accelerate's, default ``["generator"]``): with "generator" the order sampler's generator is
    rank 0's; "torch" / "cuda" are shared from rank 0 at the start of every pass.
    """
    rng_types = ["generator"] if rng_types is None else rng_types
    _check_loader(loader, config)
    per_rank = _per_rank_batch(loader, world, config)
    parts = (device, config.non_blocking, gradient_state, per_rank, loader, rng_types, hooks)
    if config.dispatch_batches or (config.dispatch_batches is None and _dispatch_by_default(loader, world, device,
                                                                                            config)):
        # rank 0 reads, every rank receives its slice (impel.runtime.loaders.dispatch)
        shard = dispatching_loader(loader, _loader_kwargs(loader), world=world, rank=rank,
                                   split_batches=config.split_batches, device=device,
                                   seedable=config.use_seedable_sampler, slice_fn=slice_fn)
        return DataLoaderDispatcher.build(shard, shard, *parts)
    if slice_fn is not None:
        raise ConfigError("slice_fn_for_dispatch only cuts dispatched batches (rank 0 reads, every rank receives its "
                          "slice), and this DataLoader is not dispatched: pass dispatch_batches=True "
                          "(DataLoaderConfiguration) or leave slice_fn_for_dispatch None")
    new, shard = _rebuild(loader, world, rank, per_rank, config, "generator" in rng_types)
    built: DataLoaderShard = DataLoaderShard.build(new, shard, *parts)
    if loader.batch_size is None and _unbatched(loader):
        built.batch_size = None  # as the user's loader: no automatic batching
    return built


def _refuse_mesh(torch_device_mesh: object, name: str) -> None:
    if torch_device_mesh is not None:
        raise ConfigError(f"{name}(torch_device_mesh=...): impel shards over the data-parallel ranks of the "
                          "Accelerator's mesh; use Accelerator(parallelism_config=...).prepare(dataloader)")


class DataLoaderShard(PreparedLoader):
    """A prepared DataLoader whose ranks each read their own shard (what ``prepare`` returns without
    ``dispatch_batches``).

    Built directly, Accelerate's constructor: ``DataLoaderShard(dataset, batch_size=4, device=...)`` is a
    ``DataLoader(dataset, **kwargs)`` (not sharded: a ``BatchSamplerShard`` batch sampler shards it) whose batches go
    to ``device``, with ``end_of_dataloader``, epochs (``iteration``) and ``set_epoch`` as on a prepared loader;
    ``rng_types`` are shared from rank 0 at each pass (``"generator"`` with ``synchronized_generator``);
    ``skip_batches`` skips that many batches of every pass; ``_drop_last`` is recorded (Accelerate's prepare passes
    the user's ``drop_last``; the batches are the rebuilt loader's).
    """

    def __init__(self, dataset: Any, device: torch.device | None = None, rng_types: list[str] | None = None,
                 synchronized_generator: torch.Generator | None = None, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 torch_device_mesh: object = None, iteration: int = 0, **kwargs: Any) -> None:
        _refuse_mesh(torch_device_mesh, "DataLoaderShard")
        loader = DataLoader(dataset, **kwargs)
        config = DataLoaderConfiguration(non_blocking=_non_blocking, use_stateful_dataloader=use_stateful_dataloader)
        per_rank = _per_rank_batch(loader, 1, config)
        new, shard = _rebuild(loader, 1, 0, per_rank, config, share_generator=False)
        self._setup(new, shard, device, _non_blocking, GradientState(), per_rank, loader, [])
        if _unbatched(loader):
            self.batch_size = None
        kinds = [str(getattr(t, "value", t)) for t in rng_types or []]
        self.rng_types = [t for t in kinds if t != "generator" or synchronized_generator is not None]
        self.synchronized_generator = synchronized_generator
        self._skip_each_pass = int(skip_batches)
        self._drop_last = _drop_last
        self.use_stateful_dataloader = use_stateful_dataloader
        self.epoch = iteration
        self.total_batch_size = _total_batch_size(loader)


def _total_batch_size(loader: DataLoader) -> int | None:
    """Accelerate's ``DataLoaderShard.total_batch_size`` for a directly built one: the batch sampler's size, times
    its ``num_processes`` unless it splits batches (a ``BatchSamplerShard``); None without a batch size."""
    batches: Any = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    size = getattr(batches, "batch_size", None)
    if size is None:
        return None
    return int(size if getattr(batches, "split_batches", False) else size * getattr(batches, "num_processes", 1))


class DataLoaderDispatcher(PreparedLoader):
    """A prepared DataLoader that rank 0 reads, every rank receiving its slice of each global batch on its device
    (:mod:`impel.runtime.loaders.dispatch`; what ``prepare`` returns with ``dispatch_batches=True``).

    Built directly, Accelerate's constructor: a ``DataLoader(dataset, **kwargs)`` read by rank 0 of
    :class:`PartialState`. ``_drop_last`` drops a last global batch too short to split (else it is completed from the
    epoch's first samples), as Accelerate's; ``drop_last`` in ``kwargs`` is rank 0's DataLoader's. ``slice_fn`` cuts
    each rank's part; ``skip_batches`` skips that many batches of every pass.
    """

    def __init__(self, dataset: Any, split_batches: bool = False, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 slice_fn: Callable[..., Any] | None = None, torch_device_mesh: object = None, iteration: int = 0,
                 **kwargs: Any) -> None:
        _refuse_mesh(torch_device_mesh, "DataLoaderDispatcher")
        loader = DataLoader(dataset, **kwargs)
        state = PartialState()
        config = DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=True,
                                         non_blocking=_non_blocking, use_stateful_dataloader=use_stateful_dataloader)
        built = shard_dataloader(loader, world=state.num_processes, rank=state.process_index, device=state.device,
                                 config=config, gradient_state=GradientState(), slice_fn=slice_fn)
        self.__dict__.update(built.__dict__)
        self.shard.drop_last = _drop_last  # whether a short last global batch is dropped (Accelerate's _drop_last)
        self.split_batches = split_batches
        self.slice_fn = slice_fn
        self._skip_each_pass = int(skip_batches)
        self.use_stateful_dataloader = use_stateful_dataloader
        self.epoch = iteration


class _SkipBatchSampler(Sampler[list[int]]):
    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip_count = batch_sampler, skip

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_count)

    def __iter__(self) -> Iterator[list[int]]:
        yield from itertools.islice(self.batch_sampler, self.skip_count, None)


def skip_first_batches(dataloader: object, num_batches: int = 0) -> Any:
    """A dataloader whose next pass starts ``num_batches`` batches in (the skipped ones are not loaded)."""
    if isinstance(dataloader, PreparedLoader):
        clone = copy.copy(dataloader)
        clone.skip_batches(num_batches)
        dataloader._skip_next = 0  # the view runs the next pass: a skip load_state left pending is not repeated
        return clone
    if isinstance(dataloader, DataLoader) and not isinstance(dataloader.dataset, IterableDataset):
        return DataLoader(dataloader.dataset, batch_sampler=_SkipBatchSampler(dataloader.batch_sampler, num_batches),
                          collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                          pin_memory=dataloader.pin_memory)
    raise ConfigError(f"skip_first_batches got {type(dataloader).__name__}; pass a prepared or map-style DataLoader")
