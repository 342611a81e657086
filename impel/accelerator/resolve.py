"""Resolve, then build: every value of a run is settled here, before any object of the run exists.

:func:`resolve` takes the launched config (file < flags, exported by ``impel launch``), the Accelerator's own
arguments, its plugins and the DeepSpeed JSON, and returns one read-only ``RunRecord``
(:mod:`impel.runtime.run_record`). The Accelerator then
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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from impel.config.deepspeed_json import settle_deepspeed
from impel.config.elastic import scaled_accumulation
from impel.config.parallelism import requested, settle
from impel.config.plugins import GradientAccumulationPlugin, Handlers
from impel.config.run_config import ConfigError, DistributedType, RunConfig, merge_code_arguments
from impel.runtime.compile import dynamo_code_arguments, settle_dynamo
from impel.runtime.process import live_device, pick_device
from impel.runtime.run_record import RunArguments, RunRecord, cpu_only_config, plugins_in_effect

if TYPE_CHECKING:
    import torch

    from impel.config.environment import Topology


def resolve(launched: Mapping[str, Any] | None, args: RunArguments, topology: Topology) -> RunRecord:
    """Settle every value from the launched config, the code's arguments and plugins, and the DeepSpeed JSON."""
    asked = requested(args.parallelism_config)  # the code's, or Accelerate's launcher variables
    code = {**_code_arguments(args), **(asked.code_arguments() if asked is not None else {})}
    config = merge_code_arguments(launched, code)
    handlers = Handlers.collect(args.kwargs_handlers)
    cpu_only = cpu_only_config(config)
    device = live_device(cpu_only) or pick_device(topology.local_rank, cpu_only)
    _check_topology(config, launched, topology)
    distributed_type = _distributed_type(config.distributed_type, topology.world_size, device)
    deepspeed = None
    if distributed_type == DistributedType.DEEPSPEED:
        deepspeed, decided = settle_deepspeed(config, args.deepspeed_plugin)
        config = config.with_values(**decided)  # what the JSON decides (accumulation steps, precision)
    elastic = config.min_machines is not None
    if elastic:  # keep micro x accumulation x world: the accumulation asked for the planned world, scaled
        steps = scaled_accumulation(config.gradient_accumulation_steps, planned_world(config, topology),
                                    topology.world_size)
        config = config.with_values(gradient_accumulation_steps=steps)
    accumulation = _accumulation(args.gradient_accumulation_plugin, config.gradient_accumulation_steps, elastic)
    dynamo = settle_dynamo(config, args.dynamo_plugin, device, distributed_type)
    fsdp_strategy = config.fsdp.resolved_sharding_strategy if distributed_type == DistributedType.FSDP else None
    parallelism = settle(config.parallelism_config, asked, topology.world_size, str(distributed_type), fsdp_strategy)
    config.freeze()
    plugins = plugins_in_effect(config, str(distributed_type), args.deepspeed_plugin)
    return RunRecord(config, handlers, topology, device, distributed_type, accumulation, dynamo, deepspeed,
                     args.deepspeed_plugin, args.fsdp_plugin, parallelism, plugins)


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


def _code_arguments(args: RunArguments) -> dict[str, Any]:
    steps = args.gradient_accumulation_steps
    if args.gradient_accumulation_plugin is not None and steps not in (None, 1):
        raise ConfigError("pass either gradient_accumulation_steps or gradient_accumulation_plugin, not both")
    if args.gradient_accumulation_plugin is not None:
        steps = args.gradient_accumulation_plugin.num_steps
    code: dict[str, Any] = {"mixed_precision": args.mixed_precision, "use_cpu": args.cpu or None,
                            "gradient_accumulation_steps": steps, "nonfinite_loss": args.nonfinite_loss}
    if args.fsdp_plugin is not None and args.deepspeed_plugin is not None:
        raise ConfigError("pass either fsdp_plugin or deepspeed_plugin, not both")
    if args.fsdp_plugin is not None:
        code.update(args.fsdp_plugin.code_arguments(args.mixed_precision))
    if args.deepspeed_plugin is not None:
        code.update(args.deepspeed_plugin.code_arguments(steps))
    code.update(dynamo_code_arguments(args.dynamo_backend, args.dynamo_plugin))  # torch.compile: impel.runtime.compile
    return code


def _check_topology(config: RunConfig, launched: Mapping[str, Any] | None, topology: Topology) -> None:
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

