"""This rank's share of an epoch: Accelerate's layout of global batches over the ranks, for the three kinds of input.

Sharding happens on sample indices (map-style datasets: :class:`ShardSampler`), on a user's index batches
(:class:`BatchShardSampler`) or on samples (iterable datasets: :class:`IterableShard`), in global batches of
``per_rank_batch * world_size`` consecutive items: rank r takes the r-th slice. So 2 ranks x batch 4 see, step by
step, exactly the samples 1 process x batch 8 sees. The last, short global batch is split as evenly as possible
(``ceil(rest / world)`` per rank) and, with ``even_batches``, completed with items from the start of the epoch; the
real samples always come first, so ``gather_for_metrics`` drops the duplicates by truncating.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

from torch.utils.data import BatchSampler, IterableDataset, Sampler

T = TypeVar("T")


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

    def _groups(self, items: Iterable[T], per_rank: int, size: Callable[[list[T]], int]) -> Iterator[list[T]]:
        world, rank = self.world, self.rank
        g = per_rank * world
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        skip, self.skip = self.skip, 0
        it = iter(items)
        initial: list[T] | None = None  # the first group (padding of a short last one starts over from it)
        produced = 0
        while buf := list(islice(it, g)):  # a group per C call: this runs once per batch
            if initial is None:
                initial = buf[:]
            if len(buf) < g:  # the short last group
                if not self.drop_last and produced >= skip:
                    self.last_real = size(buf)
                    if self.even_batches and world > 1:
                        buf.extend(initial[i % len(initial)] for i in range(g - len(buf)))
                    if buf[mine]:
                        yield buf[mine]
                return
            self.last_real = size(buf)
            if produced >= skip:
                yield buf[mine]
            produced += 1

    joined = False  # inside Accelerator.join_uneven_inputs: ranks that run out shadow the others' all-reduces

    def _chunks(self, total: int, per_rank: int, rank: int | None = None) -> int:
        """Chunks :meth:`_groups` yields to this rank (or ``rank``) for ``total`` items."""
        full, rest = divmod(total, per_rank * self.world)
        if rest == 0 or self.drop_last:
            return full
        rank = self.rank if rank is None else rank
        return full + (1 if (self.even_batches and self.world > 1) or rank * per_rank < rest else 0)

    def _sized(self) -> tuple[int, int] | None:
        """(items, items per rank per step) of an epoch, or None when the items have no length."""
        return None

    def rank_batches(self) -> list[int] | None:
        """Batches every rank gets per epoch (known from the length alone: no communication), or None."""
        sized = self._sized()
        return None if sized is None else [self._chunks(*sized, rank=r) for r in range(self.world)]

    def last_batch_size(self) -> int:
        """Real samples in the epoch's last global batch (known once the pass reached it)."""
        return self.last_real

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to whatever orders the items (a seedable sampler, a batch sampler, the dataset)."""
        for target in self._epoch_targets():
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def _epoch_targets(self) -> tuple[object, ...]:
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

    def _sized(self) -> tuple[int, int] | None:
        return len(self.sampler), self.per_rank_batch  # type: ignore[arg-type]  # a sized sampler, as in __len__

    def last_batch_size(self) -> int:
        """Real samples in the epoch's last global batch, known from the length before the pass reaches it."""
        g = self.per_rank_batch * self.world
        rest = len(self.sampler) % g  # type: ignore[arg-type]  # a sized sampler, as in __len__
        return g if rest == 0 or self.drop_last else rest

    def _epoch_targets(self) -> tuple[object, ...]:
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

    def _sized(self) -> tuple[int, int] | None:
        return (len(self.batch_sampler), 1) if hasattr(self.batch_sampler, "__len__") else None

    def _epoch_targets(self) -> tuple[object, ...]:
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

    def _epoch_targets(self) -> tuple[object, ...]:
        return (self.dataset,)

    def __len__(self) -> int:
        """Samples this rank yields per epoch; a TypeError when the dataset has no length (as in a DataLoader)."""
        b = self.per_rank_batch
        full, rest = divmod(len(self.dataset), b * self.world)
        mine = full * b
        if rest and not self.drop_last:
            mine += b if self.even_batches and self.world > 1 else max(0, min(b, rest - self.rank * b))
        return mine

    def _sized(self) -> tuple[int, int] | None:
        return (len(self.dataset), self.per_rank_batch) if hasattr(self.dataset, "__len__") else None

    def __iter__(self) -> Iterator[Any]:
        for chunk in self._groups(self.dataset, self.per_rank_batch, len):
            yield from chunk


class ItemShard(ShardSampler):
    """Single sample indices for one rank, for a DataLoader without automatic batching (``batch_size=None``): the
    layout of ``ShardSampler`` with one item per rank per step, each index yielded alone."""

    def __init__(self, sampler: Sampler[int], world: int, rank: int, even_batches: bool) -> None:
        super().__init__(sampler, 1, world, rank, False, even_batches)

    def __iter__(self) -> Iterator[int]:  # type: ignore[override]  # indices, not index lists
        for chunk in self._groups(self.sampler, 1, len):
            yield chunk[0]
