"""Accelerate's standalone data-loading pieces (``accelerate.data_loader``), built on impel's sharding
(:mod:`impel.runtime.loaders.data`): ``prepare_data_loader`` outside an Accelerator, the ``BatchSamplerShard`` /
``IterableDatasetShard`` wrappers with Accelerate's constructors, and the batch-skipping ``SkipBatchSampler`` /
``SkipDataLoader``.

Example::

    loader = prepare_data_loader(DataLoader(ds, batch_size=8, shuffle=True), put_on_device=True)
    # this rank's batches of 8, in Accelerate's layout, on PartialState().device
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from impel.config.plugins import DataLoaderConfiguration, GradientAccumulationPlugin
from impel.config.run_config import ConfigError
from impel.runtime.loaders.data import DataLoaderDispatcher as DataLoaderDispatcher  # re-exported: its earlier home
from impel.runtime.loaders.data import _SkipBatchSampler, shard_dataloader
from impel.runtime.loaders.prepared_loader import PreparedLoader
from impel.runtime.loaders.shard_layout import BatchShardSampler, IterableShard
from impel.runtime.ranks.process import PartialState
from impel.runtime.step.accumulation import GradientState


class BatchSamplerShard(BatchShardSampler):
    """``batch_sampler``'s batches for rank ``process_index`` of ``num_processes``, as Accelerate's class of that
    name: each rank takes ``batch_size`` indices of every global batch, or with ``split_batches`` its slice of each
    batch; ``even_batches`` completes the last round with indices from the start of the epoch."""

    def __init__(self, batch_sampler: BatchSampler, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        size = getattr(batch_sampler, "batch_size", None)
        if split_batches and (not isinstance(size, int) or size % num_processes):
            raise ValueError(f"split_batches=True needs the batch sampler's batch_size ({size}) to be a round multiple "
                             f"of num_processes ({num_processes}); change one of them or use split_batches=False")
        super().__init__(batch_sampler, num_processes, process_index, even_batches)
        if split_batches:
            self.batch_size = size // num_processes  # type: ignore[operator]
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches

    def __len__(self) -> int:
        if self.split_batches:  # one slice of every batch
            return len(self.batch_sampler)
        return super().__len__()


class IterableDatasetShard(IterableShard):
    """The samples of an iterable ``dataset`` for rank ``process_index``, as Accelerate's class of that name: of
    every ``batch_size * num_processes`` samples (``batch_size`` with ``split_batches``), this rank's consecutive
    share; a short last group is completed from the first samples unless ``drop_last``."""

    def __init__(self, dataset: IterableDataset[Any], batch_size: int = 1, drop_last: bool = False,
                 num_processes: int = 1, process_index: int = 0, split_batches: bool = False) -> None:
        if split_batches and batch_size % num_processes:
            raise ValueError(f"split_batches=True needs batch_size ({batch_size}) to be a round multiple of "
                             f"num_processes ({num_processes}); change one of them or use split_batches=False")
        per_rank = batch_size // num_processes if split_batches else batch_size
        super().__init__(dataset, per_rank, num_processes, process_index, drop_last, even_batches=True)
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches


class SkipBatchSampler(_SkipBatchSampler):
    """``batch_sampler`` without its first ``skip_batches`` batches (Accelerate's class)."""

    def __init__(self, batch_sampler: object, skip_batches: int = 0) -> None:
        super().__init__(batch_sampler, skip_batches)
        self.skip_batches = skip_batches

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)


class SkipDataLoader(DataLoader[Any]):
    """A DataLoader whose passes drop their first ``skip_batches`` batches (they are loaded, then discarded)."""

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader

    base_dataloader = property(lambda self: self, doc="The DataLoader it iterates: itself (Accelerate's attribute).")

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, as Accelerate's
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)


def _refuse_unsupported(dispatch_batches: bool | None, put_on_device: bool, torch_device_mesh: object) -> None:
    if dispatch_batches and not put_on_device:
        raise ConfigError("prepare_data_loader(dispatch_batches=True) broadcasts each batch on the process's device, "
                          "so it needs put_on_device=True (as Accelerate requires); pass it, or drop dispatch_batches")
    if torch_device_mesh is not None:
        raise ConfigError("prepare_data_loader(torch_device_mesh=...): impel shards over the data-parallel ranks of "
                          "the Accelerator's mesh; use Accelerator(parallelism_config=...).prepare(dataloader)")


def prepare_data_loader(dataloader: DataLoader[Any], device: torch.device | None = None,
                        num_processes: int | None = None, process_index: int | None = None,
                        split_batches: bool = False, put_on_device: bool = False, rng_types: list[str] | None = None,
                        dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Callable[..., object] | None = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: object = None) -> PreparedLoader:
    """Accelerate's ``prepare_data_loader`` outside an Accelerator: ``dataloader`` for rank ``process_index`` of
    ``num_processes`` (default :class:`PartialState`'s), the same batches as ``accelerator.prepare`` gives, on
    ``device`` (default the process's) when ``put_on_device``. With several processes a shuffling sampler takes rank
    0's generator (as ``accelerator.prepare`` does), so every rank draws the same order. ``dispatch_batches=True``
    (with ``put_on_device``): rank 0 reads and every rank receives its slice (:mod:`impel.runtime.loaders.dispatch`),
    cut by ``slice_fn_for_dispatch`` when given; None dispatches an iterable dataset (with ``put_on_device``), as
    Accelerate's."""
    _refuse_unsupported(dispatch_batches, put_on_device, torch_device_mesh)
    state = PartialState() if num_processes is None or process_index is None or put_on_device else None
    world = num_processes if num_processes is not None else state.num_processes  # type: ignore[union-attr]
    rank = process_index if process_index is not None else state.process_index  # type: ignore[union-attr]
    if not 0 <= rank < world:
        raise ConfigError(f"process_index={rank} is not a rank of num_processes={world}; pass 0 <= process_index < "
                          "num_processes")
    config = DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=dispatch_batches,
                                     even_batches=even_batches,
                                     use_seedable_sampler=use_seedable_sampler, data_seed=data_seed,
                                     non_blocking=non_blocking, use_stateful_dataloader=use_stateful_dataloader)
    target = (device if device is not None else state.device) if put_on_device else None  # type: ignore[union-attr]
    return shard_dataloader(dataloader, world=world, rank=rank, device=target, config=config,
                            gradient_state=GradientState(GradientAccumulationPlugin(num_steps=1)),
                            rng_types=list(rng_types) if rng_types is not None else None,
                            slice_fn=slice_fn_for_dispatch)
