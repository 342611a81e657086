"""``DataLoaderConfiguration(dispatch_batches=True)``: rank 0 reads the data, every rank receives its part.

Accelerate's dispatcher, with its numbers: rank 0 iterates the user's loader (its sampler, its workers) and takes
``num_processes`` batches at a time (one with ``split_batches``), concatenated into one global batch; the global
batch's layout (shapes, dtypes) goes to every rank as an object, then its tensors by ``broadcast`` on the process's
device; each rank keeps the slice ``[rank * n, (rank + 1) * n)`` with ``n = global size // num_processes``. The
last global batch, when not divisible by the number of processes, is completed with the first ``num_processes``
samples of the epoch's first global batch (``n`` + 1 per rank) unless the loader drops its last batch; with
``drop_last`` a last group of fewer than ``num_processes`` batches is dropped. Every rank starts the user's
loader at each pass (only rank 0 draws from it), so torch's global RNG sees the draws it sees under Accelerate.

:class:`DispatchingLoader` is both the loader :class:`impel.runtime.loaders.prepared_loader.PreparedLoader` iterates and
the shard it asks for ``set_epoch``, ``skip`` and the remainder, so the prepared loader keeps impel's position,
resume and ``end_of_dataloader`` bookkeeping.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from impel.config.run_config import ConfigError
from impel.runtime.ranks.collectives import broadcast, broadcast_object_list, recursively_apply, send_to_device


class DispatchingLoader(DataLoader[object]):
    """Rank 0 reads ``inner`` (the user's loader without its generator, as Accelerate rebuilds it); each rank gets
    its slice of every global batch. DataLoader attributes not defined here are ``inner``'s (a ``DataLoader``, as
    Accelerate's dispatcher's ``base_dataloader``, that never runs ``DataLoader.__init__``)."""

    def __init__(self, inner: DataLoader[object], original: DataLoader[object], world: int, rank: int,
                 split_batches: bool, device: torch.device,
                 slice_fn: Callable[..., object] | None = None) -> None:
        self.inner = inner
        self.slice_fn = slice_fn  # Accelerate's slice_fn_for_dispatch: (batch, slice, process_index=, num_processes=)
        self.world = world
        self.rank = rank
        self.split_batches = split_batches
        self.device = device
        self.drop_last = original.drop_last  # the user's (``inner`` built from a batch sampler reports False)
        size = original.batch_size
        self.per_rank_batch = (size // world if split_batches else size) if size is not None else None
        self.skip = 0  # batches of the next pass to fetch and drop (resume), set by DataLoaderShard
        self.last_real = -1  # real samples of the latest global batch when it was the epoch's last
        self.at_end = False  # the batch just yielded is the pass's last (this loader reads one ahead already)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def batch_size(self) -> int | None:  # type: ignore[override]  # read-only: computed from the split
        return self.per_rank_batch

    @property
    def sampler(self) -> object:  # type: ignore[override]  # read-only: rank 0's sampler
        """The sampler ordering the epoch on rank 0 (None for an iterable dataset)."""
        batch_sampler = self.inner.batch_sampler
        return None if isinstance(self.inner.dataset, IterableDataset) else getattr(batch_sampler, "sampler", None)

    def __len__(self) -> int:
        batches = len(self.inner)
        if self.split_batches:
            return batches
        return batches // self.world if self.drop_last else math.ceil(batches / self.world)

    def set_epoch(self, epoch: int) -> None:
        """As Accelerate's dispatcher: the sampler's ``set_epoch``, else the dataset's."""
        target = self.sampler if hasattr(self.sampler, "set_epoch") else self.inner.dataset
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)

    def last_batch_size(self) -> int:
        return self.last_real

    def __iter__(self) -> Iterator[object]:  # type: ignore[override]  # a generator, not torch's _BaseDataLoaderIter
        source = iter(self.inner)  # on every rank: the same global RNG draws as under Accelerate
        first: object = None
        current = self._fetch(source)
        index = 0
        while current is not None:
            batch = self._receive(current)
            if first is None and not self.drop_last:
                first = self._slice(batch, slice(0, self.world))
            observed = _batch_size(batch)
            per_rank = observed // self.world
            upcoming = self._fetch(source)
            if upcoming is None:
                self.last_real = observed
                if not self.drop_last and observed % self.world:
                    batch, per_rank = _concatenate([batch, first]), per_rank + 1
            if index >= self.skip:
                self.at_end = upcoming is None
                yield self._slice(batch, slice(self.rank * per_rank, (self.rank + 1) * per_rank))
            index += 1
            current = upcoming

    def _slice(self, batch: object, part: slice) -> object:
        if self.slice_fn is None:
            return _slice(batch, part)
        return self.slice_fn(batch, part, process_index=self.rank, num_processes=self.world)

    def _fetch(self, source: Iterator[object]) -> tuple[object, object] | None:
        """The next global batch on rank 0 and its layout on every rank; None when the pass is over."""
        batch = None
        if self.rank == 0:
            taken = []
            for _ in range(1 if self.split_batches else self.world):
                try:
                    taken.append(next(source))
                except StopIteration:
                    break
            short = not self.split_batches and len(taken) < self.world
            if taken and not (short and self.drop_last):
                batch = send_to_device(_concatenate(taken), self.device)
        layout = [_layout(batch) if batch is not None else None]
        broadcast_object_list(layout, from_process=0)
        return None if layout[0] is None else (batch, layout[0])

    def _receive(self, fetched: tuple[object, object]) -> object:
        batch, layout = fetched
        if self.rank != 0:
            batch = _empty_like_layout(layout, self.device)
        return broadcast(batch, from_process=0)


def dispatching_loader(loader: DataLoader[object], extra: Mapping[str, Any], *, world: int, rank: int,
                       split_batches: bool, device: torch.device | None, seedable: bool,
                       slice_fn: Callable[..., object] | None = None) -> DispatchingLoader:
    """The user's loader rebuilt as Accelerate's dispatcher rebuilds it (same dataset and batch sampler, no
    generator), behind a :class:`DispatchingLoader`; raises for what the dispatcher cannot honour."""
    import torch.distributed as dist

    if device is None:
        raise ConfigError("dispatch_batches=True broadcasts each batch on the process's device, so it needs device "
                          "placement: drop device_placement=False for this DataLoader (as Accelerate requires "
                          "put_on_device=True)")
    if seedable:
        raise ConfigError("dispatch_batches=True: rank 0 alone orders the data, so use_seedable_sampler=True has "
                          "nothing to agree on across ranks (Accelerate ignores it there); drop one of the two")
    if dist.is_initialized() and world != dist.get_world_size():
        raise ConfigError(f"dispatch_batches=True sends rank 0's batches to every process, but only {world} of the "
                          f"{dist.get_world_size()} processes are data parallel (tensor / context parallelism); drop "
                          "dispatch_batches (as Accelerate, which refuses TP with data parallelism in dispatch mode)")
    kwargs = {k: v for k, v in extra.items() if k != "generator"}
    if isinstance(loader.dataset, IterableDataset):
        inner = DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
    else:
        inner = DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **kwargs)
    return DispatchingLoader(inner, loader, world, rank, split_batches, device, slice_fn)


class _TensorLayout:
    """A tensor's shape and dtype, sent ahead so the other ranks can allocate the broadcast's buffers."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype


def _layout(batch: object) -> object:
    return recursively_apply(_TensorLayout, batch, error_on_other_type=False)


def _empty_like_layout(layout: object, device: torch.device) -> object:
    if isinstance(layout, _TensorLayout):
        return torch.empty(layout.shape, dtype=layout.dtype, device=device)
    rebuild: Callable[..., object] = type(layout)  # the concrete container class (dict, namedtuple, ...)
    if isinstance(layout, Mapping):
        return rebuild({k: _empty_like_layout(v, device) for k, v in layout.items()})
    if isinstance(layout, (list, tuple)):
        items = [_empty_like_layout(v, device) for v in layout]
        return rebuild(*items) if hasattr(layout, "_fields") else rebuild(items)
    return layout  # a non-tensor leaf travelled whole with the layout


def _concatenate(batches: list[Any]) -> object:
    """Batches of the same structure joined along their first dimension (tensors only)."""
    head = batches[0]
    if isinstance(head, torch.Tensor):
        try:
            return torch.cat(batches, dim=0)
        except RuntimeError as error:
            raise ConfigError(f"dispatch_batches=True joins {len(batches)} batches into one global batch, but their "
                              f"shapes differ ({[tuple(b.shape) for b in batches]}): pad them to one shape in the "
                              "collate_fn, or pass split_batches=True (rank 0 reads one global batch)") from error
    rebuild: Callable[..., object] = type(head)  # the concrete container class (dict, namedtuple, ...)
    if isinstance(head, Mapping):
        return rebuild({k: _concatenate([b[k] for b in batches]) for k in head})
    if isinstance(head, (list, tuple)):
        parts = [_concatenate([b[i] for b in batches]) for i in range(len(head))]
        return rebuild(*parts) if hasattr(head, "_fields") else rebuild(parts)
    return head


def _batch_size(batch: object) -> int:
    sizes: list[int] = []
    recursively_apply(lambda t: sizes.append(int(t.shape[0])) if t.ndim else None, batch, error_on_other_type=False)
    if not sizes:
        raise ConfigError("dispatch_batches=True needs batches holding tensors with a batch dimension")
    return sizes[0]


def _slice(batch: object, part: slice) -> object:
    return recursively_apply(lambda t: t[part] if t.ndim else t, batch, error_on_other_type=False)
