"""What only Accelerate's compatible faces use (a room of ``impel.runtime``, layer 2): the implementations behind
``impel.utils``, ``impel.launchers``, ``impel.logging`` and ``impel.big_modeling``, kept apart from the process,
the step and the data path, which the Accelerator itself runs on.

``availability`` (``is_*_available``), ``launchers`` (start a function on N processes: ``notebook_launcher``,
``debug_launcher``), ``logger`` (per-process logging), ``progress_bar`` (per-process tqdm), ``operations`` (Accelerate's
tensor helpers: ``recursively_apply``, ``send_to_device``, ...), ``module_tools`` (module helpers), ``pyutils``
(small Python helpers), ``model_loading`` (weights without allocation, ``load_checkpoint_in_model``).
"""
