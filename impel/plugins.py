"""Configuration objects users build in code, with Accelerate's names and fields.

They are thin: each validates its own fields and the Accelerator reads them; none holds behaviour.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from .config import ConfigError


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}({name}={value!r}) must be True or False")


class KwargsHandler:
    """Base of the ``kwargs_handlers`` objects: ``to_kwargs()`` returns only the fields changed from defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        default = self.__class__()
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.nn.parallel.DistributedDataParallel``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.amp.GradScaler`` (fp16 only)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.init_scale <= 0 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ConfigError(f"{self!r} is invalid: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1")


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Process-group settings: backend (None = nccl on CUDA, gloo on CPU) and the collective timeout."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in ("nccl", "gloo", "mpi", "cpu:gloo,cuda:nccl"):
            raise ConfigError(f"InitProcessGroupKwargs(backend={self.backend!r}) is unknown; use 'nccl', 'gloo' or None")
        if self.timeout is not None and (not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0):
            raise ConfigError(f"InitProcessGroupKwargs(timeout={self.timeout!r}) must be a positive datetime.timedelta")


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast`` inside the prepared model's forward."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard and place batches.

    split_batches: the loader's batch_size is the global batch, split across ranks (must divide evenly);
    otherwise it is the per-rank batch. even_batches: the last global batch is completed with samples from the
    start so every rank runs the same number of steps (``gather_for_metrics`` drops the duplicates).
    use_seedable_sampler: shuffles come from (seed, epoch), identical on every rank and reproducible on resume.
    non_blocking: host-to-device copies are asynchronous (pin_memory recommended).
    """

    split_batches: bool = False
    even_batches: bool = True
    use_seedable_sampler: bool = True
    non_blocking: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_bool("DataLoaderConfiguration", f.name, getattr(self, f.name))


@dataclass
class GradientAccumulationPlugin:
    """Gradient accumulation settings.

    num_steps: micro-steps per optimizer step. adjust_scheduler: the scheduler steps only when the optimizer
    really steps (False: on every call). sync_with_dataloader: the end of a prepared dataloader ends the group.
    sync_each_batch: all-reduce gradients on every micro-step (less memory, more communication).
    """

    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ConfigError(f"GradientAccumulationPlugin(num_steps={self.num_steps!r}) must be an integer >= 1")
        for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
            _check_bool("GradientAccumulationPlugin", name, getattr(self, name))


KWARGS_HANDLER_TYPES = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs)


@dataclass
class Handlers:
    """The kwargs handlers a user passed, one per type at most."""

    ddp: DistributedDataParallelKwargs | None = None
    scaler: GradScalerKwargs | None = None
    init: InitProcessGroupKwargs | None = None
    autocast: AutocastKwargs | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def collect(cls, handlers: Any) -> "Handlers":
        out = cls()
        slots = {DistributedDataParallelKwargs: "ddp", GradScalerKwargs: "scaler",
                 InitProcessGroupKwargs: "init", AutocastKwargs: "autocast"}
        for handler in handlers or ():
            slot = slots.get(type(handler))
            if slot is None:
                names = ", ".join(t.__name__ for t in KWARGS_HANDLER_TYPES)
                raise ConfigError(f"kwargs_handlers got {handler!r}; allowed types are {names}")
            if getattr(out, slot) is not None:
                raise ConfigError(f"kwargs_handlers holds two {type(handler).__name__}; pass one")
            setattr(out, slot, handler)
        return out
