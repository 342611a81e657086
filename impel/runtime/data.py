"""Prepared dataloaders: per-rank shards, device placement, even batches, epochs and resumable position.

Sharding happens on sample indices (map-style datasets) or on samples (iterable datasets), in global batches
of ``per_rank_batch * world_size`` consecutive samples: rank r takes the r-th slice. So 2 ranks x batch 4 see, step
by step, exactly the samples 1 process x batch 8 sees. The last, short global batch is split as evenly as
possible (``ceil(rest / world)`` per rank) and, with ``even_batches``, completed with samples from the start of the
epoch; the real samples always come first, so ``gather_for_metrics`` drops the duplicates by truncating.
"""
from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from impel.config.plugins import DataLoaderConfiguration
from impel.config.run_config import ConfigError
from impel.runtime import collectives
from impel.runtime.collectives import send_to_device
from impel.runtime.dispatch import dispatching_loader
from impel.runtime.loader_attributes import loader_attributes
from impel.runtime.samplers import SeedableRandomSampler as SeedableRandomSampler  # re-exported: Accelerate's path
from impel.runtime.seeding import synchronize_rng_states


class _ShardLayout:
    """Accelerate's layout of one epoch over the ranks, shared by the three shard kinds below.

    One loop (:meth:`_groups`) cuts every global group of ``per_rank * world`` consecutive items (sample indices,
    whole index batches, or samples of an iterable dataset) and yields this rank's chunk. A short last group is
    dropped with ``drop_last``; otherwise, on several ranks with ``even_batches``, it is completed by cycling
    through the epoch's first items, so the real items come first and every rank gets a full chunk. The one
    notion of the remainder is ``last_real``: the real samples in the latest global group (``gather_for_metrics``
    drops what the completion added). ``skip`` groups are passed over at the next pass (resume).
    """

    def __init__(self, world: int, rank: int, drop_last: bool, even_batches: bool) -> None:
        self.world, self.rank = world, rank
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.skip = 0
        self.last_real = -1

    def _groups(self, items: Iterable[Any], per_rank: int, size: Callable[[list[Any]], int]) -> Iterator[list[Any]]:
        world, rank = self.world, self.rank
        g = per_rank * world
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        skip, self.skip = self.skip, 0
        buf: list[Any] = []
        initial: list[Any] = []
        produced = 0
        for item in items:
            if len(initial) < g:
                initial.append(item)
            buf.append(item)
            if len(buf) == g:
                self.last_real = size(buf)
                if produced >= skip:
                    yield buf[mine]
                produced += 1
                buf = []
        if buf and not self.drop_last and produced >= skip:
            self.last_real = size(buf)
            if self.even_batches and world > 1:
                buf.extend(initial[i % len(initial)] for i in range(g - len(buf)))
            if buf[mine]:
                yield buf[mine]

    def _chunks(self, total: int, per_rank: int) -> int:
        """Chunks :meth:`_groups` yields to this rank for ``total`` items."""
        full, rest = divmod(total, per_rank * self.world)
        if rest == 0 or self.drop_last:
            return full
        return full + (1 if (self.even_batches and self.world > 1) or self.rank * per_rank < rest else 0)

    def last_batch_size(self) -> int:
        """Real samples in the epoch's last global batch (known once the pass reached it)."""
        return self.last_real

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to whatever orders the items (a seedable sampler, a batch sampler, the dataset)."""
        for target in self._epoch_targets():
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def _epoch_targets(self) -> tuple[Any, ...]:
        return ()


class ShardSampler(_ShardLayout, Sampler[list[int]]):
    """Batches of sample indices for one rank (map-style datasets): the r-th slice of each global batch."""

    def __init__(self, sampler: Sampler[int], per_rank_batch: int, world: int, rank: int, drop_last: bool,
                 even_batches: bool) -> None:
        _ShardLayout.__init__(self, world, rank, drop_last, even_batches)
        self.sampler = sampler
        self.per_rank_batch = self.batch_size = per_rank_batch  # batch_size: Accelerate's BatchSamplerShard's name

    batch_sampler = property(lambda self: BatchSampler(self.sampler, self.per_rank_batch, self.drop_last),
                             doc="The batches before sharding, per-rank size (Accelerate's BatchSamplerShard's name)")

    def __len__(self) -> int:
        return self._chunks(len(self.sampler), self.per_rank_batch)  # type: ignore[arg-type]

    def last_batch_size(self) -> int:
        """Real samples in the epoch's last global batch, known from the length before the pass reaches it."""
        g = self.per_rank_batch * self.world
        rest = len(self.sampler) % g  # type: ignore[arg-type]  # a sized sampler, as in __len__
        return g if rest == 0 or self.drop_last else rest

    def _epoch_targets(self) -> tuple[Any, ...]:
        return (self.sampler,)

    def __iter__(self) -> Iterator[list[int]]:
        return self._groups(self.sampler, self.per_rank_batch, len)


class BatchShardSampler(_ShardLayout, Sampler[list[int]]):
    """A user's own batch sampler, sharded as Accelerate does.

    With a ``batch_size`` attribute (torch's BatchSampler and most custom ones) the indices are laid out like
    ``ShardSampler``'s, ``batch_size`` per rank; without one, whole batches go round the ranks (r, r+W, ...).
    """

    def __init__(self, batch_sampler: Any, world: int, rank: int, even_batches: bool) -> None:
        _ShardLayout.__init__(self, world, rank, bool(getattr(batch_sampler, "drop_last", False)), even_batches)
        self.batch_sampler = batch_sampler
        size = getattr(batch_sampler, "batch_size", None)
        self.batch_size = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def __len__(self) -> int:
        return self._chunks(len(self.batch_sampler), 1)

    def _epoch_targets(self) -> tuple[Any, ...]:
        return (self.sampler, self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        if self.batch_size is not None:
            indices = (i for batch in self.batch_sampler for i in batch)
            yield from self._groups(indices, self.batch_size, len)
            return
        for chunk in self._groups((list(b) for b in self.batch_sampler), 1, lambda group: sum(len(b) for b in group)):
            yield chunk[0]


class IterableShard(_ShardLayout, IterableDataset):
    """Samples of an iterable dataset for one rank, in the same global-batch layout as ``ShardSampler``."""

    def __init__(self, dataset: Any, per_rank_batch: int, world: int, rank: int, drop_last: bool,
                 even_batches: bool) -> None:
        _ShardLayout.__init__(self, world, rank, drop_last, even_batches)
        self.dataset = dataset
        self.per_rank_batch = per_rank_batch

    def _epoch_targets(self) -> tuple[Any, ...]:
        return (self.dataset,)

    def __len__(self) -> int:
        """Samples this rank yields per epoch; a TypeError when the dataset has no length (as in a DataLoader)."""
        b = self.per_rank_batch
        full, rest = divmod(len(self.dataset), b * self.world)
        mine = full * b
        if rest and not self.drop_last:
            mine += b if self.even_batches and self.world > 1 else max(0, min(b, rest - self.rank * b))
        return mine

    def __iter__(self) -> Iterator[Any]:
        for chunk in self._groups(self.dataset, self.per_rank_batch, len):
            yield from chunk


_END = object()


class DataLoaderShard(DataLoader[Any]):
    """A prepared DataLoader: this rank's batches, on the device, with epoch and position tracking.

    A ``torch.utils.data.DataLoader`` (``isinstance`` holds) with its attributes (``batch_sampler``, ``drop_last``,
    ``num_workers``, ...: :mod:`impel.runtime.loader_attributes`); it iterates ``base_dataloader``, the loader over this
    rank's shard.

    Iterating it sets ``end_of_dataloader`` while the last batch is being used (one batch of look-ahead), which
    gradient accumulation and ``gather_for_metrics`` read. A complete pass advances the epoch by itself, so
    shuffles differ per epoch even without ``set_epoch``; ``set_epoch(n)`` sets it explicitly.
    """

    def __init__(self, loader: DataLoader, shard: Any, device: torch.device | None, non_blocking: bool,
                 gradient_state: Any, per_rank_batch: int, original: DataLoader,
                 rng_types: list[str] | None = None, hooks: Any = None) -> None:
        self.base_dataloader = loader
        self.rng_types = [t for t in rng_types or [] if t != "generator"]  # shared from rank 0 at each pass
        self.shard = shard
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.total_batch_size = per_rank_batch * getattr(shard, "world", 1)
        self.original = original
        # epoch, position and the pass's random states live in one shared record, so a skip_first_batches() view
        # advances the original, consumes a resume pending on it, and leaves its pass start for state_dict()
        self._progress: dict[str, Any] = {"epoch": 0, "position": 0, "pass_start": None, "resume_rng": None}
        self.hooks = hooks  # impel.accelerator.resilience.Resilience (auto-resume and preemption checks), or None
        self.end_of_dataloader = False
        self._skip_next = 0
        self.__dict__.update(loader_attributes(loader, original, getattr(shard, "sampler", None),
                                               getattr(shard, "per_rank_batch", None)))

    epoch = property(lambda self: self._progress["epoch"],
                     lambda self, value: self._progress.__setitem__("epoch", value),
                     doc="The epoch the next (or current) pass uses for its shuffle.")
    position = property(lambda self: self._progress["position"],
                        lambda self, value: self._progress.__setitem__("position", value),
                        doc="Batches of the current epoch consumed, skipped ones included.")
    _pass_start = property(lambda self: self._progress["pass_start"],  # random states the current pass started from
                           lambda self, value: self._progress.__setitem__("pass_start", value))
    _resume_rng = property(lambda self: self._progress["resume_rng"],  # set by load_state_dict, used by the next pass
                           lambda self, value: self._progress.__setitem__("resume_rng", value))

    def __len__(self) -> int:
        return len(self.base_dataloader)  # batches of this rank's shard; a TypeError for unsized iterables

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self.shard.set_epoch(epoch)  # at once, as Accelerate's (a batch sampler's epoch reads back); again per pass

    @property
    def remainder(self) -> int:
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
        self.shard.set_epoch(self.epoch)
        self.shard.skip = self._skip_next
        self.position = self._skip_next
        self._skip_next = 0

    # --- the random states a pass draws from (exact resume) --------------------------------------------------
    def _generators(self) -> dict[str, torch.Generator]:
        """The generators a pass draws from: the loader's (worker base seed) and the order sampler's."""
        gens = {}
        loader_gen = self.base_dataloader.generator
        if loader_gen is not None:
            gens["loader"] = loader_gen
        order_gen = getattr(self.sampler, "generator", None)
        if isinstance(order_gen, torch.Generator) and order_gen is not loader_gen \
                and not isinstance(self.sampler, SeedableRandomSampler):  # that one is re-seeded every pass
            gens["order"] = order_gen
        return gens

    def _draws_from_global_rng(self) -> bool:
        """A pass draws from torch's global RNG: the worker base seed, or a sampler without a generator."""
        sampler = self.sampler
        unseeded = sampler is not None and not isinstance(sampler, SequentialSampler) \
            and getattr(sampler, "generator", None) is None
        return self.base_dataloader.generator is None or unseeded

    def _begin_pass(self) -> tuple[Iterator[Any], Any]:
        """Start the base loader's pass and fetch its first batch.

        A pass draws its worker base seed and its order when it starts. A resumed pass mid-epoch replays those
        draws from the states the interrupted pass started from: generators are set back, and torch's global RNG
        is swapped in only for the start, so the live global stream (restored by ``load_state``) is not consumed
        twice.
        """
        resume, self._resume_rng = self._resume_rng, None
        replay = (resume or {}).get("global")
        if replay is None and self.rng_types:
            synchronize_rng_states(self.rng_types)  # Accelerator(rng_types=[...]) as in Accelerate
        gens = self._generators()
        for name, state in (resume or {}).items():
            if name in gens:
                gens[name].set_state(state)
        start = {name: gen.get_state() for name, gen in gens.items()}
        if replay is not None:
            start["global"] = replay
        elif self._draws_from_global_rng():
            start["global"] = torch.get_rng_state()
        self._pass_start = start
        live = torch.get_rng_state() if replay is not None else None
        if replay is not None:
            torch.set_rng_state(replay)
        try:
            it = iter(self.base_dataloader)
            return it, next(it, _END)
        finally:
            if live is not None:
                torch.set_rng_state(live)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not torch's _BaseDataLoaderIter
        hooks = self.hooks
        if hooks is not None:
            hooks.on_iter_start(self)  # auto-resume: may restore epoch and position before the epoch starts
        self._start_epoch()
        self.end_of_dataloader = False
        state = self.gradient_state
        state.register_dataloader(self)
        finished = False
        try:
            it, current = self._begin_pass()
            if current is _END and self.position == 0:
                _warn_empty(self)
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
            state.unregister_dataloader(self)
            if finished:
                self.epoch += 1
                self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position in it, and the random states that make a resumed pass draw the same order."""
        # a skip set by load_state_dict/skip_batches and not yet iterated is the position to save
        position = self._skip_next or self.position
        state: dict[str, Any] = {"epoch": self.epoch, "position": position}
        if isinstance(self.sampler, SeedableRandomSampler):
            state["seed"] = self.sampler.seed
        if self._resume_rng is not None:
            state["rng"] = self._resume_rng
        elif self.position > 0 and not self._skip_next and self._pass_start is not None:
            state["rng"] = self._pass_start  # mid-epoch: what this pass started from
        else:  # between passes: the generators as they are (the global RNG is saved with the process's RNG)
            state["rng"] = {name: gen.get_state() for name, gen in self._generators().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.skip_batches(int(state["position"]))
        if isinstance(self.sampler, SeedableRandomSampler) and state.get("seed") is not None:
            self.sampler.seed = int(state["seed"])
        rng = state.get("rng") or {}
        if int(state["position"]) == 0:
            rng = {k: v for k, v in rng.items() if k != "global"}
        self._resume_rng = dict(rng) or None


def _warn_empty(loader: DataLoaderShard) -> None:  # an empty dataset, or every batch dropped by drop_last
    world, data = getattr(loader.shard, "world", 1), loader.dataset
    if world == 1 or loader.shard.even_batches:  # else another rank may have the batches: nothing is wrong
        count = f"{len(data)} samples" if hasattr(data, "__len__") else "no length (an iterable)"
        warnings.warn(f"a prepared DataLoader gave this rank no batch: its dataset has {count}, batch_size="
                      f"{loader.batch_size} per process on {world} process(es), drop_last={loader.original.drop_last}"
                      "; the loop runs no step: check the dataset, or lower batch_size / drop_last=False", stacklevel=3)


def _check_loader(loader: DataLoader) -> None:
    if any(isinstance(s, DistributedSampler) for s in (loader.sampler, getattr(loader, "batch_sampler", None))):
        raise ConfigError("the DataLoader already uses a DistributedSampler; impel shards data itself, so build "
                          "the DataLoader with shuffle=True/False instead of a DistributedSampler")
    if loader.batch_size is None and loader.batch_sampler is None and not isinstance(loader.sampler, BatchSampler):
        raise ConfigError("DataLoader(batch_size=None) (no automatic batching) cannot be sharded unless its sampler "
                          "is a BatchSampler; give it a batch_size, a batch_sampler or sampler=BatchSampler(...)")


def agree_on_generator(sampler: Any) -> None:
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


def _order_sampler(sampler: Any, world: int, config: DataLoaderConfiguration, share_generator: bool) -> Any:
    """The sampler that orders one epoch's indices: the user's, made seedable or agreed across ranks."""
    if isinstance(sampler, RandomSampler) and config.use_seedable_sampler:
        seed = config.data_seed if config.data_seed is not None else torch.initial_seed()
        return SeedableRandomSampler.from_sampler(sampler, int(collectives.broadcast(int(seed), from_process=0)))
    if world > 1 and share_generator:
        agree_on_generator(sampler)
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
