"""Prepared dataloaders: per-rank shards, device placement, even batches, epochs and resumable position.

Sharding happens on sample indices (map-style datasets) or on samples (iterable datasets), in global batches
of ``per_rank_batch * world_size`` consecutive samples: rank r takes the r-th slice. So 2 ranks x batch 4 see, step
by step, exactly the samples 1 process x batch 8 sees. The last, short global batch is split as evenly as
possible (``ceil(rest / world)`` per rank) and, with ``even_batches``, completed with samples from the start of the
epoch; the real samples always come first, so ``gather_for_metrics`` drops the duplicates by truncating.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import (DataLoader, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)
from torch.utils.data.distributed import DistributedSampler

from .config import ConfigError
from .plugins import DataLoaderConfiguration


def send_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor inside dicts, lists, tuples, namedtuples and ``.to``-able objects to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        moved = [send_to_device(o, device, non_blocking) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, Mapping):
        moved_map = {k: send_to_device(v, device, non_blocking) for k, v in obj.items()}
        try:
            return type(obj)(moved_map)
        except TypeError:
            return moved_map
    to = getattr(obj, "to", None)
    if callable(to):
        try:
            return to(device)
        except TypeError:
            return obj
    return obj


class EpochSampler(Sampler[int]):
    """The epoch's sample order, identical on every rank: a permutation seeded by (seed, epoch), or 0..n-1."""

    def __init__(self, num_items: int, shuffle: bool, seed: int, replacement: bool = False,
                 num_samples: int | None = None, seed_source: Callable[[int], int] | None = None) -> None:
        self.num_items = num_items
        self.shuffle = shuffle
        self.seed = seed
        self.replacement = replacement
        self.num_samples = num_items if num_samples is None else num_samples
        self.seed_source = seed_source  # non-seedable mode: draws a fresh seed per epoch (agreed across ranks)
        self.epoch = 0
        self.epoch_seed: int | None = None  # the seed the current epoch's order came from
        self.resume_seed: int | None = None  # set by a resume: the interrupted epoch's seed, used once

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            yield from range(self.num_items)
            return
        if self.resume_seed is not None:
            seed, self.resume_seed = self.resume_seed, None
        else:
            seed = self.seed_source(self.epoch) if self.seed_source else self.seed + self.epoch
        self.epoch_seed = seed
        g = torch.Generator()
        g.manual_seed(seed)
        if self.replacement:
            yield from torch.randint(self.num_items, (self.num_samples,), generator=g).tolist()
            return
        order: list[int] = []
        while len(order) < self.num_samples:
            order.extend(torch.randperm(self.num_items, generator=g).tolist())
        yield from order[: self.num_samples]


def _last_chunk(buf: list[Any], first: list[Any], world: int, rank: int, even: bool) -> tuple[list[Any], int]:
    """This rank's part of a short final global batch, padded from ``first`` when ``even``."""
    rest = len(buf)
    per_rank = math.ceil(rest / world)
    if even:
        pool = first or buf
        i = 0
        while len(buf) < per_rank * world:
            buf.append(pool[i % len(pool)])
            i += 1
    return buf[rank * per_rank:(rank + 1) * per_rank], rest


class ShardSampler(Sampler[list[int]]):
    """Batches of sample indices for one rank (map-style datasets)."""

    def __init__(self, sampler: Sampler[int], per_rank_batch: int, world: int, rank: int, drop_last: bool,
                 even_batches: bool) -> None:
        self.sampler = sampler
        self.per_rank_batch = per_rank_batch
        self.world = world
        self.rank = rank
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.skip = 0

    @property
    def global_batch(self) -> int:
        return self.per_rank_batch * self.world

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.global_batch)  # type: ignore[arg-type]
        if rest == 0 or self.drop_last:
            return full
        per_rank = math.ceil(rest / self.world)
        return full + (1 if self.even_batches or self.rank * per_rank < rest else 0)

    def last_batch_size(self) -> int:
        """Real samples in the epoch's last global batch."""
        rest = len(self.sampler) % self.global_batch  # type: ignore[arg-type]
        return self.global_batch if rest == 0 or self.drop_last else rest

    def __iter__(self) -> Iterator[list[int]]:
        g, b, r = self.global_batch, self.per_rank_batch, self.rank
        skip, self.skip = self.skip, 0
        buf: list[int] = []
        first: list[int] = []
        produced = 0
        for idx in self.sampler:
            if len(first) < g:
                first.append(idx)
            buf.append(idx)
            if len(buf) == g:
                if produced >= skip:
                    yield buf[r * b:(r + 1) * b]
                produced += 1
                buf = []
        if buf and not self.drop_last and produced >= skip:
            chunk, _ = _last_chunk(buf, first, self.world, r, self.even_batches)
            if chunk:
                yield chunk


class BatchShardSampler(Sampler[list[int]]):
    """A user's own batch sampler, sharded by whole batches: rank r takes batches r, r+W, ..."""

    def __init__(self, batch_sampler: Any, world: int, rank: int, even_batches: bool) -> None:
        self.batch_sampler = batch_sampler
        self.world = world
        self.rank = rank
        self.even_batches = even_batches
        self.skip = 0
        self._last_real = -1

    def __len__(self) -> int:
        full, rest = divmod(len(self.batch_sampler), self.world)
        return full + (1 if rest and (self.even_batches or self.rank < rest) else 0)

    def last_batch_size(self) -> int:
        return self._last_real

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        group: list[list[int]] = []
        first: list[list[int]] = []
        produced = 0
        for batch in self.batch_sampler:
            if len(first) < self.world:
                first.append(list(batch))
            group.append(list(batch))
            if len(group) == self.world:
                self._last_real = sum(len(x) for x in group)
                if produced >= skip:
                    yield group[self.rank]
                produced += 1
                group = []
        if group and produced >= skip:
            self._last_real = sum(len(x) for x in group)
            if self.rank < len(group):
                yield group[self.rank]
            elif self.even_batches:
                yield first[self.rank % len(first)]


class IterableShard(IterableDataset):
    """Samples of an iterable dataset for one rank, in the same global-batch layout as ``ShardSampler``."""

    def __init__(self, dataset: Any, per_rank_batch: int, world: int, rank: int, drop_last: bool,
                 even_batches: bool) -> None:
        self.dataset = dataset
        self.per_rank_batch = per_rank_batch
        self.world = world
        self.rank = rank
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.skip = 0
        self.last_real = -1

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this rank yields per epoch; a TypeError when the dataset has no length (as in a DataLoader)."""
        full, rest = divmod(len(self.dataset), self.per_rank_batch * self.world)
        mine = full * self.per_rank_batch
        if rest and not self.drop_last:
            per_rank = math.ceil(rest / self.world)
            mine += per_rank if self.even_batches else max(0, min(per_rank, rest - self.rank * per_rank))
        return mine

    def __iter__(self) -> Iterator[Any]:
        g, b, r = self.per_rank_batch * self.world, self.per_rank_batch, self.rank
        skip, self.skip = self.skip, 0
        buf: list[Any] = []
        first: list[Any] = []
        produced = 0
        for sample in self.dataset:
            if len(first) < g:
                first.append(sample)
            buf.append(sample)
            if len(buf) == g:
                self.last_real = g
                if produced >= skip:
                    yield from buf[r * b:(r + 1) * b]
                produced += 1
                buf = []
        if buf and not self.drop_last and produced >= skip:
            chunk, self.last_real = _last_chunk(buf, first, self.world, r, self.even_batches)
            yield from chunk


_END = object()


class DataLoaderShard:
    """A prepared DataLoader: this rank's batches, on the device, with epoch and position tracking.

    Iterating it sets ``end_of_dataloader`` while the last batch is being used (one batch of look-ahead), which
    gradient accumulation and ``gather_for_metrics`` read. A complete pass advances the epoch by itself, so
    shuffles differ per epoch even without ``set_epoch``; ``set_epoch(n)`` sets it explicitly.
    """

    def __init__(self, loader: DataLoader, shard: Any, device: torch.device | None, non_blocking: bool,
                 gradient_state: Any, per_rank_batch: int, original: DataLoader) -> None:
        self.base_dataloader = loader
        self.shard = shard
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.total_batch_size = per_rank_batch * getattr(shard, "world", 1)
        self.original = original
        # epoch and position live in one shared record, so a skip_first_batches() view advances the original
        self._progress = {"epoch": 0, "position": 0}
        self.hooks: Any = None  # impel.resilience.Resilience: auto-resume and preemption checks
        self.end_of_dataloader = False
        self._skip_next = 0
        self._epoch_generator_state: torch.Tensor | None = None

    epoch = property(lambda self: self._progress["epoch"],
                     lambda self, value: self._progress.__setitem__("epoch", value),
                     doc="The epoch the next (or current) pass uses for its shuffle.")
    position = property(lambda self: self._progress["position"],
                        lambda self, value: self._progress.__setitem__("position", value),
                        doc="Batches of the current epoch consumed, skipped ones included.")

    # --- DataLoader look-alike ------------------------------------------------------------------------------
    @property
    def dataset(self) -> Any:
        return self.original.dataset

    @property
    def batch_size(self) -> int | None:
        return self.base_dataloader.batch_size or getattr(self.shard, "per_rank_batch", None)

    @property
    def sampler(self) -> Any:
        return getattr(self.shard, "sampler", None)

    def __len__(self) -> int:
        if isinstance(self.shard, IterableShard):
            return len(self.base_dataloader)  # raises TypeError for unsized iterables, like DataLoader
        return len(self.shard)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0

    @property
    def remainder(self) -> int:
        if isinstance(self.shard, IterableShard):
            return self.shard.last_real
        return self.shard.last_batch_size()

    def remaining_batches(self) -> int | None:
        """Batches left in this epoch, counting the one in use, or None when the length is unknown."""
        try:
            return len(self) - self.position + 1
        except TypeError:
            return None

    def skip_batches(self, num_batches: int) -> None:
        """Make the next iteration start ``num_batches`` into the epoch (without loading them)."""
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be >= 0")
        self._skip_next = num_batches

    def _start_epoch(self) -> None:
        sampler = getattr(self.shard, "sampler", None)
        for target in (sampler, self.shard, getattr(self.shard, "batch_sampler", None)):
            if isinstance(target, EpochSampler):
                target.epoch = self.epoch
            elif target is not None and hasattr(target, "set_epoch") and target is not self.shard:
                target.set_epoch(self.epoch)
        if isinstance(self.shard, IterableShard):
            self.shard.set_epoch(self.epoch)
        self.shard.skip = self._skip_next
        self.position = self._skip_next
        self._skip_next = 0

    def __iter__(self) -> Iterator[Any]:
        hooks = self.hooks
        if hooks is not None:
            hooks.on_iter_start(self)  # auto-resume: may restore epoch and position before the epoch starts
        self._start_epoch()
        self.end_of_dataloader = False
        state = self.gradient_state
        state.active_dataloaders.append(self)
        finished = False
        gen = self.base_dataloader.generator
        self._epoch_generator_state = gen.get_state() if gen is not None else None
        try:
            it = iter(self.base_dataloader)
            current = next(it, _END)
            while current is not _END:
                if hooks is not None:
                    hooks.before_batch(self)  # preemption: a step boundary, before this batch counts as drawn
                upcoming = next(it, _END)
                self.end_of_dataloader = upcoming is _END
                self.position += 1
                if self.device is not None:
                    current = send_to_device(current, self.device, self.non_blocking)
                yield current
                current = upcoming
            finished = True
        finally:
            self.end_of_dataloader = False
            if self in state.active_dataloaders:
                state.active_dataloaders.remove(self)
            if finished:
                self.epoch += 1
                self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position in it, and the seeds and generator states that make a resumed pass identical."""
        # a skip set by load_state_dict/skip_batches and not yet iterated is the position to save
        position = self._skip_next or self.position
        state: dict[str, Any] = {"epoch": self.epoch, "position": position}
        sampler = self.sampler
        if isinstance(sampler, EpochSampler):
            pending = sampler.resume_seed if sampler.resume_seed is not None else sampler.epoch_seed
            state.update(seed=sampler.seed, epoch_seed=pending)
        gen = self.base_dataloader.generator
        if gen is not None:
            # mid-epoch, the state before this epoch's iter() drew its worker base seed, so the resumed iter()
            # draws the same one
            mid = self.position > 0 and not self._skip_next and self._epoch_generator_state is not None
            state["generator"] = self._epoch_generator_state if mid else gen.get_state()
        user_gen = getattr(self.original.sampler, "generator", None)
        if isinstance(user_gen, torch.Generator):
            state["sampler_generator"] = user_gen.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.skip_batches(int(state["position"]))
        sampler = self.sampler
        if isinstance(sampler, EpochSampler) and state.get("seed") is not None:
            sampler.seed = int(state["seed"])
            mid = int(state["position"]) > 0 and state.get("epoch_seed") is not None
            sampler.resume_seed = int(state["epoch_seed"]) if mid else None
        if state.get("generator") is not None and self.base_dataloader.generator is not None:
            self.base_dataloader.generator.set_state(state["generator"])
        user_gen = getattr(self.original.sampler, "generator", None)
        if state.get("sampler_generator") is not None and isinstance(user_gen, torch.Generator):
            user_gen.set_state(state["sampler_generator"])


def _check_loader(loader: DataLoader) -> None:
    if isinstance(loader.sampler, DistributedSampler) or isinstance(getattr(loader, "batch_sampler", None),
                                                                    DistributedSampler):
        raise ConfigError("the DataLoader already uses a DistributedSampler; impel shards data itself, so build "
                          "the DataLoader with shuffle=True/False instead of a DistributedSampler")
    if loader.batch_size is None and loader.batch_sampler is None:
        raise ConfigError("DataLoader(batch_size=None) (no automatic batching) cannot be sharded; give it a "
                          "batch_size or a batch_sampler")


def _epoch_sampler(loader: DataLoader, seed: int, config: DataLoaderConfiguration,
                   seed_source: Callable[[int], int] | None) -> Sampler[int]:
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        return EpochSampler(len(sampler.data_source), True, seed, sampler.replacement, sampler.num_samples,
                            None if config.use_seedable_sampler else seed_source)
    if isinstance(sampler, SequentialSampler):
        return EpochSampler(len(sampler.data_source), False, seed)
    return sampler  # a user sampler: used as is, it must produce the same order on every rank


def _base_seed_generator(loader: DataLoader) -> torch.Generator:
    """The generator each pass draws its worker base seed from: the user's, else a private one.

    A DataLoader without a generator draws that seed from torch's global RNG at every ``iter()``; a resumed run
    starts one extra pass mid-epoch, which would shift the global stream (dropout masks) off the uninterrupted one.
    """
    if loader.generator is not None:
        return loader.generator
    gen = torch.Generator()
    gen.manual_seed(torch.initial_seed())
    return gen


def shard_dataloader(loader: DataLoader, *, world: int, rank: int, device: torch.device | None,
                     config: DataLoaderConfiguration, gradient_state: Any, seed: int,
                     seed_source: Callable[[int], int] | None = None) -> DataLoaderShard:
    """Rebuild ``loader`` so this rank reads its shard; the result iterates like the original."""
    _check_loader(loader)
    per_rank = loader.batch_size or 0
    if config.split_batches and loader.batch_size is not None:
        if loader.batch_size % world:
            raise ConfigError(f"split_batches=True needs the DataLoader batch_size ({loader.batch_size}) to be a "
                              f"multiple of the number of processes ({world}); change one of them")
        per_rank = loader.batch_size // world
    extra: dict[str, Any] = {"collate_fn": loader.collate_fn, "num_workers": loader.num_workers,
                             "pin_memory": loader.pin_memory, "timeout": loader.timeout,
                             "worker_init_fn": loader.worker_init_fn, "generator": _base_seed_generator(loader),
                             "persistent_workers": loader.persistent_workers,
                             "multiprocessing_context": loader.multiprocessing_context}
    if loader.num_workers > 0:
        extra["prefetch_factor"] = loader.prefetch_factor
    if isinstance(loader.dataset, IterableDataset):
        if loader.num_workers > 0:
            raise ConfigError(f"DataLoader(num_workers={loader.num_workers}) over an IterableDataset: impel shards "
                              "iterable datasets in the main process; use num_workers=0 or a map-style dataset")
        shard: Any = IterableShard(loader.dataset, per_rank, world, rank, loader.drop_last, config.even_batches)
        new = DataLoader(shard, batch_size=per_rank, drop_last=loader.drop_last, **extra)
    elif loader.batch_size is None:  # the user's own batch_sampler
        if config.split_batches:
            raise ConfigError("split_batches=True needs a DataLoader with batch_size, not a custom batch_sampler")
        shard = BatchShardSampler(loader.batch_sampler, world, rank, config.even_batches)
        new = DataLoader(loader.dataset, batch_sampler=shard, **extra)
    else:
        sampler = _epoch_sampler(loader, seed, config, seed_source)
        shard = ShardSampler(sampler, per_rank, world, rank, loader.drop_last, config.even_batches)
        new = DataLoader(loader.dataset, batch_sampler=shard, **extra)
    return DataLoaderShard(new, shard, device, config.non_blocking, gradient_state, per_rank, loader)


class _SkipBatchSampler(Sampler[list[int]]):
    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip_count = skip

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_count)

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip_count:
                yield batch


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A dataloader whose next pass starts ``num_batches`` batches in (the skipped ones are not loaded)."""
    if isinstance(dataloader, DataLoaderShard):
        clone = copy.copy(dataloader)
        clone.skip_batches(num_batches)
        return clone
    if isinstance(dataloader, DataLoader) and not isinstance(dataloader.dataset, IterableDataset):
        return DataLoader(dataloader.dataset, batch_sampler=_SkipBatchSampler(dataloader.batch_sampler, num_batches),
                          collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                          pin_memory=dataloader.pin_memory)
    raise ConfigError(f"skip_first_batches got {type(dataloader).__name__}; pass a prepared or map-style DataLoader")
