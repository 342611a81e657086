"""The run record: every value of a run, settled by :func:`impel.accelerator.resolve.resolve` before any object of
the run exists, and the Accelerator's arguments that take part in settling it.

The strategies, the process and the compiler are built from a :class:`RunRecord` alone; nothing writes into it
afterwards (its ``RunConfig`` is frozen). It lives here, below the strategies that read it, while the resolution
that fills it is the Accelerator's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from impel.config.deepspeed_json import Resolved
    from impel.config.environment import Topology
    from impel.config.parallelism import ParallelismConfig
    from impel.config.plugins import (
        DeepSpeedPlugin,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        Handlers,
    )
    from impel.config.run_config import DistributedType, RunConfig
    from impel.runtime.compile import TorchDynamoPlugin


@dataclass(frozen=True)
class RunArguments:
    """The Accelerator's arguments that take part in resolution (None: not given in code)."""

    mixed_precision: str | None = None
    cpu: bool | None = None
    gradient_accumulation_steps: int | None = None
    gradient_accumulation_plugin: GradientAccumulationPlugin | None = None
    nonfinite_loss: str | None = None
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    deepspeed_plugin: DeepSpeedPlugin | None = None
    dynamo_backend: Any = None
    dynamo_plugin: TorchDynamoPlugin | None = None
    kwargs_handlers: Sequence[Any] | None = None
    parallelism_config: ParallelismConfig | None = None


@dataclass(frozen=True)
class RunRecord:
    """A run, fully settled. ``config`` is read-only; ``deepspeed`` is the DeepSpeed JSON after settlement."""

    config: RunConfig
    handlers: Handlers
    topology: Topology
    device: torch.device
    distributed_type: DistributedType
    accumulation: GradientAccumulationPlugin
    dynamo_plugin: TorchDynamoPlugin
    deepspeed: Resolved | None = None
    deepspeed_plugin: DeepSpeedPlugin | None = None  # the one given in code (its dict JSON stays in the process)
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    parallelism: ParallelismConfig | None = None  # the mesh sizes, settled against the world size

    @property
    def cpu_only(self) -> bool:
        return cpu_only_config(self.config)


def cpu_only_config(config: RunConfig) -> bool:
    """Train on the CPU even where a GPU is visible: ``cpu=True`` / ``use_cpu``, or a MULTI_CPU launch."""
    return bool(config.use_cpu or config.distributed_type == "MULTI_CPU")
