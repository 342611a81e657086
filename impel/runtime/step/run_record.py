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
    from impel.runtime.step.compile import TorchDynamoPlugin


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
    deepspeed_plugin_name: str | None = None  # its key in Accelerator(deepspeed_plugins={name: plugin})
    more_deepspeed_plugins: tuple[tuple[str, DeepSpeedPlugin], ...] = ()  # the other named plugins, in order


@dataclass(frozen=True)
class PluginsInEffect:
    """``accelerator.deepspeed_plugin`` / ``fsdp_plugin``: the plugin given in code, else one built from the resolved
    config when the run is resolved (never on read); None for the strategy not in use."""

    deepspeed: DeepSpeedPlugin | None = None
    fsdp: FullyShardedDataParallelPlugin | None = None


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
    plugins: PluginsInEffect = PluginsInEffect()
    deepspeed_plugin_name: str | None = None  # Accelerate's deepspeed_plugins={name: plugin}: the plugin's key
    # every named plugin (the first is deepspeed_plugin) with its settled JSON; () when given without a name
    deepspeed_named: tuple[tuple[str, DeepSpeedPlugin, Resolved], ...] = ()
    cpu_only: bool = False  # cpu=True / use_cpu, or a MULTI_CPU launch (resolve.cpu_only_config)
