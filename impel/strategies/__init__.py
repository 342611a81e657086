"""Layer 4, strategies: single device, DDP, FSDP2 and DeepSpeed behind one contract (:mod:`impel.strategies.base`).

Nothing is imported here, so that importing one strategy does not load the others.

- ``base``: the contract; ``single``, ``ddp``, ``fsdp`` (with ``fsdp_wrap``, ``fsdp_loading``), ``deepspeed`` (with
  ``deepspeed_report``, ``deepspeed_plugins``: several
  plugins' settled JSON and the active one) and ``tensor_parallel``.
"""
