"""Resolve, then build: every value of a run is settled here, before any object of the run exists.

:func:`resolve` takes the launched config (file < flags, exported by ``impel launch``), the Accelerator's own
arguments, its plugins and the DeepSpeed JSON, and returns one read-only ``RunRecord``
(:mod:`impel.runtime.step.run_record`). The Accelerator then
builds from the record alone: the process (joins the process group), the accumulation state, the strategy and the
compiler, each given what it needs in its constructor. Nothing writes into the record afterwards: its
``RunConfig`` is frozen (an assignment raises), and what the DeepSpeed JSON decides (accumulation steps, precision)
is already in it.

Example::

    record = resolve(env.read_launch_config(), RunArguments(mixed_precision="bf16"))
    record.config.mixed_precision          # 'bf16'
    record.distributed_type                # DistributedType.NO on one process
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from impel.config.deepspeed_json import get, json_source, load_json, resolve_static, settle_deepspeed
from impel.config.elastic import scaled_accumulation
from impel.config.parallelism import ParallelismConfig, TorchTensorParallelPlugin, requested, settle
from impel.config.plugins import DeepSpeedPlugin, GradientAccumulationPlugin, Handlers
from impel.config.run_config import ConfigError, DistributedType, RunConfig, merge_code_arguments
from impel.config.unsupported import NotProvidedError
from impel.runtime.ranks.process import live_device, pick_device
from impel.runtime.step.compile import dynamo_code_arguments, settle_dynamo
from impel.runtime.step.run_record import PluginsInEffect, RunArguments, RunRecord

if TYPE_CHECKING:
    import torch

    from impel.config.deepspeed_json import Resolved
    from impel.config.environment import Topology


def resolve(launched: Mapping[str, object] | None, args: RunArguments, topology: Topology) -> RunRecord:
    """Settle every value from the launched config, the code's arguments and plugins, and the DeepSpeed JSON."""
    asked = requested(args.parallelism_config)  # the code's, or Accelerate's launcher variables
    code = {**_code_arguments(args), **(asked.code_arguments() if asked is not None else {})}
    config = merge_code_arguments(launched, code)
    handlers = Handlers.collect(args.kwargs_handlers)
    cpu_only = cpu_only_config(config)
    device = live_device(cpu_only) or pick_device(topology.local_rank, cpu_only)
    _check_topology(config, launched, topology)
    distributed_type = _distributed_type(config.distributed_type, topology.world_size, device)
    deepspeed: Resolved | None = None
    named: tuple[tuple[str, DeepSpeedPlugin, Resolved], ...] = ()
    if distributed_type == DistributedType.DEEPSPEED:
        deepspeed, decided = settle_deepspeed(config, args.deepspeed_plugin)
        config = config.with_values(**decided)  # what the JSON decides (accumulation steps, precision)
        named = _settle_named(launched, args, asked, config, deepspeed)
    elastic = config.min_machines is not None
    if elastic:  # keep micro x accumulation x world: the accumulation asked for the planned world, scaled
        steps = scaled_accumulation(config.gradient_accumulation_steps, planned_world(config, topology),
                                    topology.world_size)
        config = config.with_values(gradient_accumulation_steps=steps)
    accumulation = _accumulation(args.gradient_accumulation_plugin, config.gradient_accumulation_steps, elastic)
    dynamo = settle_dynamo(config, args.dynamo_plugin, device, distributed_type == DistributedType.DEEPSPEED)
    fsdp_strategy = config.fsdp.resolved_sharding_strategy if distributed_type == DistributedType.FSDP else None
    parallelism = settle(config.parallelism_config, asked, topology.world_size, str(distributed_type), fsdp_strategy)
    config.freeze()
    plugins = plugins_in_effect(config, str(distributed_type), args.deepspeed_plugin)
    return RunRecord(config, handlers, topology, device, distributed_type, accumulation, dynamo, deepspeed,
                     args.deepspeed_plugin, args.fsdp_plugin, parallelism, plugins, args.deepspeed_plugin_name, named,
                     cpu_only)


def cpu_only_config(config: RunConfig) -> bool:
    """Train on the CPU even where a GPU is visible: ``cpu=True`` / ``use_cpu``, or a MULTI_CPU launch."""
    return bool(config.use_cpu or config.distributed_type == "MULTI_CPU")


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


def accelerate_plugins(deepspeed_plugin: GivenDeepSpeed, deepspeed_plugins: GivenDeepSpeed,
                       torch_tp_plugin: TorchTensorParallelPlugin | None, megatron_lm_plugin: object,
                       parallelism_config: ParallelismConfig | None
                       ) -> tuple[DeepSpeedPlugin | None, str | None, tuple[tuple[str, DeepSpeedPlugin], ...],
                                  ParallelismConfig | None]:
    """Accelerate's plugin arguments that impel maps onto its own: the DeepSpeed plugin (``deepspeed_plugin`` or
    ``deepspeed_plugins``, a plugin or a ``{name: plugin}`` dict), the first one's name and the other named plugins,
    and the ``ParallelismConfig`` (``torch_tp_plugin``, Accelerate's deprecated spelling of ``tp_size``). What impel
    cannot honour raises: Megatron-LM."""
    if megatron_lm_plugin is not None:
        raise NotProvidedError(f"Accelerator(megatron_lm_plugin={type(megatron_lm_plugin).__name__}(...)): impel "
                               "does not drive Megatron-LM; use FSDP (fsdp_plugin=...), DeepSpeed (deepspeed_plugin="
                               "...) or tensor parallelism (parallelism_config=ParallelismConfig(tp_size=...))")
    if deepspeed_plugin is not None and deepspeed_plugins is not None:
        raise ValueError("pass either deepspeed_plugin or deepspeed_plugins, not both (deepspeed_plugins is "
                         "Accelerate's alias)")
    plugin, name, others = _deepspeed_plugins(deepspeed_plugins if deepspeed_plugins is not None else deepspeed_plugin)
    if torch_tp_plugin is not None:
        if parallelism_config is not None:
            raise ConfigError("pass either torch_tp_plugin or parallelism_config, not both (torch_tp_plugin is "
                              "Accelerate's deprecated spelling of parallelism_config=ParallelismConfig(tp_size=...))")
        if not isinstance(torch_tp_plugin, TorchTensorParallelPlugin):
            raise TypeError(f"torch_tp_plugin must be a TorchTensorParallelPlugin, got "
                            f"{type(torch_tp_plugin).__name__}")
        warnings.warn("TorchTensorParallelPlugin is deprecated (as in Accelerate); pass parallelism_config="
                      f"ParallelismConfig(tp_size={torch_tp_plugin.tp_size}) instead", FutureWarning, stacklevel=3)
        parallelism_config = torch_tp_plugin.parallelism_config()
    return plugin, name, others, parallelism_config


NamedPlugins = tuple[tuple[str, DeepSpeedPlugin], ...]
GivenDeepSpeed = DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None  # Accelerator(deepspeed_plugin[s]=...)


def _deepspeed_plugins(given: GivenDeepSpeed) -> tuple[DeepSpeedPlugin | None, str | None, NamedPlugins]:
    """The first (active) DeepSpeed plugin, its name (None when given without one) and the other named plugins."""
    if not isinstance(given, dict):
        if given is not None and not isinstance(given, DeepSpeedPlugin):
            raise TypeError(f"deepspeed_plugin must be a DeepSpeedPlugin, got {type(given).__name__}")
        return given, None, ()
    bad = [key for key, value in given.items() if not isinstance(value, DeepSpeedPlugin)]
    if bad:
        raise TypeError(f"deepspeed_plugins={{...}}: the value of {bad[0]!r} is not a DeepSpeedPlugin")
    if not given:
        raise ValueError("deepspeed_plugins={}: give at least one {name: DeepSpeedPlugin(...)}")
    if len({id(plugin) for plugin in given.values()}) != len(given):
        raise ValueError("deepspeed_plugins={...} holds the same DeepSpeedPlugin object under two names; build one "
                         "plugin per name")
    (name, plugin), *others = given.items()
    return plugin, str(name), tuple((str(key), value) for key, value in others)


def _settle_named(launched: Mapping[str, object] | None, args: RunArguments, asked: ParallelismConfig | None,
                  run: RunConfig, first: Resolved) -> tuple[tuple[str, DeepSpeedPlugin, Resolved], ...]:
    """Every named DeepSpeed plugin with its settled JSON (Accelerate's several plugins: the first is active). The
    others settle as the first would (launch config < Accelerator arguments < the plugin < its JSON), at the run's
    mixed precision and, where their JSON leaves it open, its accumulation steps."""
    if args.deepspeed_plugin_name is None or args.deepspeed_plugin is None:
        return ()
    named = [(args.deepspeed_plugin_name, args.deepspeed_plugin, first)]
    for name, plugin in args.more_deepspeed_plugins:
        code = {**_code_arguments(dataclasses.replace(args, deepspeed_plugin=plugin)),
                **(asked.code_arguments() if asked is not None else {})}
        config = merge_code_arguments(launched, code).with_values(
            mixed_precision=run.mixed_precision, gradient_accumulation_steps=run.gradient_accumulation_steps)
        config.explicit["mixed_precision"] = run.mixed_precision
        given = json_source(config, plugin)
        ds, source = load_json(given)
        _check_same_precision(ds, source, run.mixed_precision, name, args.deepspeed_plugin_name)
        resolved, _ = resolve_static(ds, source, config, json_given=given is not None)
        named.append((name, plugin, resolved))
    return tuple(named)


def _check_same_precision(ds: Mapping[str, object], source: str, mode: str, name: str, first: str) -> None:
    for section in ("bf16", "fp16"):
        enabled = get(ds, f"{section}.enabled")
        if isinstance(enabled, bool) and enabled != (mode == section):
            raise NotProvidedError(
                f"deepspeed_plugins[{name!r}]: {section}.enabled={str(enabled).lower()} in {source}, but the run's "
                f"mixed precision is {mode!r} (settled with the first plugin, {first!r}); impel runs every engine of "
                f"an Accelerator at one precision (one autocast in the prepared forward): write \"auto\" for "
                f"{section}.enabled (it then runs at the run's precision), or build that engine yourself with "
                f"deepspeed.initialize(model=..., config=...)")


def _accumulation(plugin: GradientAccumulationPlugin | None, steps: int,
                  elastic: bool = False) -> GradientAccumulationPlugin:
    """The plugin given in code (its ``num_steps=None`` filled with the settled steps; an elastic job's scaled
    steps replace its own), else one of ``steps``."""
    if plugin is None:
        return GradientAccumulationPlugin(steps)
    return dataclasses.replace(plugin, num_steps=steps) if plugin.num_steps is None or elastic else plugin


def planned_world(config: RunConfig, topology: Topology) -> int:
    """The processes an elastic job was planned for: ``num_processes``, else ``num_machines`` x this machine's."""
    return config.num_processes or config.num_machines * topology.local_world_size


def _code_arguments(args: RunArguments) -> dict[str, object]:
    steps = args.gradient_accumulation_steps
    if args.gradient_accumulation_plugin is not None and steps not in (None, 1):
        raise ConfigError("pass either gradient_accumulation_steps or gradient_accumulation_plugin, not both")
    if args.gradient_accumulation_plugin is not None:
        steps = args.gradient_accumulation_plugin.num_steps
    code: dict[str, object] = {"mixed_precision": args.mixed_precision, "use_cpu": args.cpu or None,
                            "gradient_accumulation_steps": steps, "nonfinite_loss": args.nonfinite_loss}
    if args.fsdp_plugin is not None and args.deepspeed_plugin is not None:
        raise ConfigError("pass either fsdp_plugin or deepspeed_plugin, not both")
    if args.fsdp_plugin is not None:
        code.update(args.fsdp_plugin.code_arguments(args.mixed_precision))
    if args.deepspeed_plugin is not None:
        code.update(args.deepspeed_plugin.code_arguments(steps))
    # torch.compile: impel.runtime.step.compile
    code.update(dynamo_code_arguments(args.dynamo_backend, args.dynamo_plugin))
    return code


def _check_topology(config: RunConfig, launched: Mapping[str, object] | None, topology: Topology) -> None:
    wanted = config.num_processes
    if config.min_machines is not None:  # elastic: any whole number of machines from min_machines up
        world, local = topology.world_size, topology.local_world_size
        low, high = config.min_machines * local, planned_world(config, topology)
        if world % local or not low <= world <= high:
            raise ConfigError(f"this elastic job has WORLD_SIZE={world} but was planned for {low} to {high} "
                              f"processes in machines of {local}; relaunch with impel launch or fix the config")
        return
    if "num_processes" in (launched or {}) and wanted is not None and wanted != topology.world_size:
        raise ConfigError(f"the launch config says num_processes={wanted} but this job has WORLD_SIZE="
                          f"{topology.world_size}; relaunch with impel launch or fix the config")


def _distributed_type(asked: str | None, world: int, device: torch.device) -> DistributedType:
    plain = "NO" if world == 1 else ("MULTI_GPU" if device.type == "cuda" else "MULTI_CPU")
    if asked in (None, "NO", "MULTI_CPU", "MULTI_GPU"):
        if asked == "NO" and world > 1:
            raise ConfigError(f"distributed_type='NO' but {world} processes were launched; set "
                              "distributed_type to MULTI_CPU/MULTI_GPU or launch one process")
        if asked == "MULTI_GPU" and world > 1 and device.type != "cuda":
            raise ConfigError("distributed_type='MULTI_GPU' but no CUDA device is visible; use MULTI_CPU "
                              "(--cpu) or run on GPU machines")
        return DistributedType(plain)
    return DistributedType(asked)

