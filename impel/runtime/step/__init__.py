"""The training step (a room of ``impel.runtime``, layer 2).

``accumulation`` (``GradientState`` and the micro-step; the only writer of the gradient state), ``model_forward``
(the prepared forward: autocast, output conversion), ``precision`` (autocast, the GradScaler, dtypes),
``precision_report`` (what a run holds in which dtype), ``optimizer`` (the prepared optimizer and scheduler),
``compile`` (torch.compile of prepared models), ``context_parallel`` (the sequence split over the cp ranks),
``item_windows`` (token-level losses exact under accumulation and ranks), ``run_record`` (the run, settled before
anything is built: what the strategies read), ``memory`` (OOM retry, releasing memory).
"""
