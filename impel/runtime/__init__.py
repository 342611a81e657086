"""Layer 2, the runtime: the process and the training step, below any strategy.

Four rooms, each with a map in its ``__init__``: ``ranks`` (the process, its topology and process group,
collectives, who runs what, the stall watchdog, a clean exit), ``step`` (accumulation, precision, the prepared
forward, optimizer and scheduler, torch.compile, context parallelism, the run record), ``loaders`` (the data path:
a ``DataLoader`` prepared into this rank's batches, dispatching, samplers, seeding) and ``compat`` (what only
Accelerate's compatible faces use: ``impel.utils``' helpers, the launchers, logging, model loading).
"""
