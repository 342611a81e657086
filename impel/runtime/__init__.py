"""Layer 2, the runtime: the process and the training step, below any strategy.

- ``process``: topology, device and process-group setup (``PartialState`` / ``AcceleratorState``);
  ``process_control``: who runs what (``main_process_first``, ``on_*_process``); ``teardown``: clean exit.
- ``collectives``, ``splitting``, ``seeding``: cross-rank operations, per-rank shares, RNG agreement.
- ``accumulation``: ``GradientState`` and the micro-step; ``optimizer``: prepared optimizer and scheduler.
- ``precision``, ``precision_report``, ``model_forward``, ``compile``: autocast, dtypes, the prepared forward,
  torch.compile.
- ``data``: prepared dataloaders; ``model_loading``: weights without allocation; ``memory``: OOM retry.
- ``logger``, ``progress_bar``: per-process logging and progress; ``availability``: ``is_*_available``.
- ``context_parallel``: the sequence split over the cp ranks; ``launchers``: start a function on N processes.
"""
