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
    deepspeed_plugin_name: str | None = None  # its key in Accelerator(deepspeed_plugins={name: plugin})
    more_deepspeed_plugins: tuple[tuple[str, DeepSpeedPlugin], ...] = ()  # the other named plugins, in order


@dataclass(frozen=True)
class PluginsInEffect:
    """``accelerator.deepspeed_plugin`` / ``fsdp_plugin``: the plugin given in code, else one built from the resolved
    config when the run is resolved (never on read); None for the strategy not in use."""

    deepspeed: DeepSpeedPlugin | None = None
    fsdp: FullyShardedDataParallelPlugin | None = None


def plugins_in_effect(config: RunConfig, distributed_type: str, deepspeed_plugin: DeepSpeedPlugin | None
                      ) -> PluginsInEffect:
    from impel.config.plugins import _DEEPSPEED_KEYS, _FSDP_KEYS, DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if distributed_type == "DEEPSPEED":
        if deepspeed_plugin is not None:
            return PluginsInEffect(deepspeed=deepspeed_plugin)
        ds = config.deepspeed
        return PluginsInEffect(deepspeed=DeepSpeedPlugin(
            hf_ds_config=ds.deepspeed_config_file, gradient_accumulation_steps=config.gradient_accumulation_steps,
            **{attr: getattr(ds, name) for attr, name in _DEEPSPEED_KEYS.items()}))
    if distributed_type == "FSDP":
        fsdp = config.fsdp
        return PluginsInEffect(fsdp=FullyShardedDataParallelPlugin(
            mixed_precision_policy=config.mixed_precision,
            **{attr: getattr(fsdp, name) for attr, name in _FSDP_KEYS.items()}))
    return PluginsInEffect()


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

    @property
    def cpu_only(self) -> bool:
        return cpu_only_config(self.config)


def cpu_only_config(config: RunConfig) -> bool:
    """Train on the CPU even where a GPU is visible: ``cpu=True`` / ``use_cpu``, or a MULTI_CPU launch."""
    return bool(config.use_cpu or config.distributed_type == "MULTI_CPU")
