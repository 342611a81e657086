"""The data path (a room of ``impel.runtime``, layer 2): a ``DataLoader`` prepared into this rank's batches.

``data`` (``shard_dataloader``, ``skip_first_batches``: Accelerate's ``DataLoaderShard`` / ``DataLoaderDispatcher``),
``prepared_loader`` (what every prepared loader does: ``PreparedLoader``), ``shard_layout`` (this rank's share of an
epoch, Accelerate's layout), ``dispatch`` (``dispatch_batches``: rank 0 reads, the ranks receive), ``samplers``
(seedable samplers), ``seeding`` (RNG agreement across ranks), ``loader_attributes`` (what a prepared loader shows of
a ``DataLoader``), ``loader_state`` (resumable position), ``loader_wrappers`` (Accelerate's standalone data-loading
pieces).
"""
