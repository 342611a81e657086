"""Strategies: single device, DDP, FSDP2 and DeepSpeed behind one contract (:mod:`impel.strategies.base`).

Nothing is imported here, so that a settings module such as ``impel.strategies.deepspeed_config`` can be read
without loading the strategies themselves.
"""
