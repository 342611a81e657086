"""Layer 2, the runtime: the process and the training step, below any strategy.

- ``process``: topology, device and process-group setup (``PartialState`` / ``AcceleratorState``);
  ``process_control``: who runs what (``main_process_first``, ``on_*_process``); ``teardown``: clean exit.
- ``collectives``, ``splitting``, ``seeding``: cross-rank operations, per-rank shares, RNG agreement.
- ``accumulation``: ``GradientState`` and the micro-step; ``optimizer``: prepared optimizer and scheduler.
- ``precision``, ``precision_report``, ``model_forward``, ``compile``: autocast, dtypes, the prepared forward,
  torch.compile.
- ``data``: preparing a dataloader (``shard_dataloader``, ``skip_first_batches``) into Accelerate's
  ``DataLoaderShard`` / ``DataLoaderDispatcher``; ``shard_layout``: this rank's share of an epoch (Accelerate's
  layout); ``prepared_loader``: what every prepared loader does (``PreparedLoader``).
- ``model_loading``: weights without allocation; ``memory``: OOM retry.
- ``logger``, ``progress_bar``: per-process logging and progress; ``availability``: ``is_*_available``.
- ``context_parallel``: the sequence split over the cp ranks; ``launchers``: start a function on N processes.
- ``run_record``: the run, settled before anything is built (what the strategies read).
- ``dispatch``: ``dispatch_batches`` (rank 0 reads, ranks receive); ``loader_attributes``: what a prepared loader
  shows of a ``DataLoader``; ``loader_wrappers`` and ``samplers``: Accelerate's standalone data-loading pieces.
- ``item_windows``: token-level losses exact under accumulation and ranks.
- ``operations``, ``module_tools``, ``pyutils``: Accelerate's tensor, module and small Python helpers.
- ``rank_health``: who waits for whom (the stall watchdog) and the ranks' normal-exit notes.
"""
