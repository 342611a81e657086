"""What a prepared DataLoader shows of ``torch.utils.data.DataLoader``, as Accelerate's prepared loaders do.

impel's prepared loader (:class:`impel.runtime.loaders.prepared_loader.PreparedLoader`) is a ``DataLoader`` subclass
(``isinstance`` is True) that iterates a rebuilt loader over this rank's shard. It carries the attributes code
reads from a DataLoader:

- from the rebuilt loader: ``batch_sampler`` (this rank's batches of indices, the shard sampler with ``even_batches``
  and ``drop_last``; torch's ``BatchSampler`` over an iterable dataset's shard), ``collate_fn``, ``num_workers``,
  ``generator``, ``pin_memory``, ``timeout``, ``worker_init_fn``, ``prefetch_factor``, ``persistent_workers``,
  ``multiprocessing_context``;
- from the user's loader: ``dataset`` and ``drop_last`` (Accelerate's rebuilt map-style loader reports
  ``drop_last=False`` because it is built from a batch sampler; the shard honours the user's value, and so does
  this attribute);
- impel's: ``batch_size`` is the batch size per rank (Accelerate's map-style loader reports None there, being built
  from a batch sampler; ``total_batch_size`` is the global one) and ``sampler`` the sampler that orders the epoch
  (the user's, or the seedable one), which ``set_epoch`` reaches.

They are plain attributes set once at ``prepare``; the loader's behaviour (order, position, resume) does not read
them, so changing one afterwards changes nothing but what it reads back, as on an iterating torch DataLoader.
"""
from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

_FROM_REBUILT = ("batch_sampler", "collate_fn", "num_workers", "generator", "pin_memory", "timeout", "worker_init_fn",
                 "prefetch_factor", "persistent_workers")


def loader_attributes(rebuilt: DataLoader[Any], original: DataLoader[Any], sampler: object,
                      per_rank_batch: int | None) -> dict[str, Any]:
    """The DataLoader attributes of a prepared loader (its instance ``__dict__`` entries)."""
    out = {name: getattr(rebuilt, name) for name in _FROM_REBUILT}
    out.update(dataset=original.dataset, drop_last=original.drop_last, sampler=sampler,
               batch_size=rebuilt.batch_size or per_rank_batch)
    # DataLoader.multiprocessing_context is a property over this name-mangled slot
    out["_DataLoader__multiprocessing_context"] = rebuilt.multiprocessing_context
    return out
