"""Strategies: single device, DDP (and, as they land, FSDP2 and DeepSpeed) behind one contract."""
from .base import REGISTRY, Strategy, load_strategy

__all__ = ["REGISTRY", "Strategy", "load_strategy"]
