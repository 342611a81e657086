"""The Accelerator's run settings as Accelerate exposes them: readable properties, the three setters Accelerate has
(``gradient_accumulation_steps``, ``sync_gradients``, ``even_batches``) and the active plugins.

A mixin over ``self.config`` (the resolved :class:`impel.config.run_config.RunConfig`), ``self.gradient_state``,
``self.dataloader_config`` and ``self.handlers``; the Accelerator is the only class that uses it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from impel.config.run_config import ConfigError, DistributedType

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from impel.config.parallelism import ParallelismConfig
    from impel.config.plugins import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DeepSpeedPlugin,
        DistributedDataParallelKwargs,
        FullyShardedDataParallelPlugin,
        GradScalerKwargs,
        Handlers,
        InitProcessGroupKwargs,
    )
    from impel.config.profiling import ProfileKwargs
    from impel.config.run_config import RunConfig
    from impel.runtime.ranks.process import ProcessState
    from impel.runtime.step.accumulation import GradientState
    from impel.runtime.step.run_record import RunRecord
    from impel.strategies.base import Strategy


class RunSettings:
    """device, num_processes, process_index and the other process facts; gradient_accumulation_steps /
    sync_gradients / even_batches (with setters), deepspeed_plugin, fsdp_plugin, multi_device, is_fsdp2, the
    dataloader switches, verify_device_map."""

    config: RunConfig
    gradient_state: GradientState
    dataloader_config: DataLoaderConfiguration
    handlers: Handlers
    record: RunRecord
    distributed_type: DistributedType
    state: ProcessState
    strategy: Strategy

    # --- this process (read from the state) -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    # --- accumulation -----------------------------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"gradient_accumulation_steps={value!r} must be an integer >= 1")
        if self.strategy.engine_managed:
            raise ConfigError(f"gradient_accumulation_steps={value} cannot change after the Accelerator is built under "
                              "DeepSpeed (its engine config fixes it); pass Accelerator(gradient_accumulation_steps="
                              f"{value}) or set it in the DeepSpeed JSON")
        self.gradient_state.set_accumulation_steps(value)

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step reduces gradients and lets the optimizer step (set by ``accumulate()``)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"sync_gradients={value!r} must be True or False")
        self.gradient_state.set_sync_gradients(value)

    # --- dataloaders ------------------------------------------------------------------------------------------
    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        """Applies to dataloaders prepared afterwards (as in Accelerate); ``join_uneven_inputs(even_batches=...)``
        changes prepared ones for a block."""
        if not isinstance(value, bool):
            raise ConfigError(f"even_batches={value!r} must be True or False")
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def dispatch_batches(self) -> bool:
        """False unless configured: impel never sends batches from rank 0, every rank reads its own shard."""
        return bool(getattr(self.dataloader_config, "dispatch_batches", False))

    @property
    def use_stateful_dataloader(self) -> bool:
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    # --- topology and plugins ---------------------------------------------------------------------------------
    @property
    def multi_device(self) -> bool:
        """Several GPUs under plain DDP (Accelerate's definition: MULTI_CPU does not count)."""
        return self.use_distributed and self.strategy.uses_ddp and self.device.type != "cpu"

    @property
    def is_fsdp2(self) -> bool:
        """True under FSDP (impel's FSDP is always FSDP2)."""
        return self.strategy.fsdp2

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def profile_handler(self) -> ProfileKwargs | None:
        """The ``ProfileKwargs`` passed in ``kwargs_handlers`` (``profile()`` uses it)."""
        return self.handlers.profile

    # the other kwargs handlers passed in ``kwargs_handlers`` (None when not given), under Accelerate's names
    @property
    def ddp_handler(self) -> DistributedDataParallelKwargs | None:
        return self.handlers.ddp

    @property
    def scaler_handler(self) -> GradScalerKwargs | None:
        return self.handlers.scaler

    @property
    def init_handler(self) -> InitProcessGroupKwargs | None:
        return self.handlers.init

    @property
    def autocast_handler(self) -> AutocastKwargs | None:
        return self.handlers.autocast

    @property
    def native_amp(self) -> bool:
        """True under fp16 or bf16 mixed precision (torch's autocast)."""
        return self.config.mixed_precision in ("fp16", "bf16")

    @property
    def fp8_enabled(self) -> bool:
        """Always False: impel has no fp8 mode."""
        return False

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The DeepSpeed settings in effect (the plugin passed in code, else one built from the resolved config when
        the run was resolved); with several named plugins, the active one (``selected``: the first, until
        ``accelerator.state.select_deepspeed_plugin(name)``); None when DeepSpeed is not used."""
        named = self.record.deepspeed_named
        if named:
            return next((plugin for _, plugin, _ in named if plugin.selected), named[0][1])
        return self.record.plugins.deepspeed

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin | None:
        """The FSDP settings in effect as a plugin (built from the resolved config when the run was resolved); None
        when FSDP is not used."""
        return self.record.plugins.fsdp

    # --- N-D parallelism (ParallelismConfig) ----------------------------------------------------------------
    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The settled ``ParallelismConfig`` (sizes checked against the world size); None when none was asked for."""
        return self.record.parallelism

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The ``DeviceMesh`` built from ``parallelism_config`` (dims ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``
        and the flattened ``dp``, ``dp_shard_cp``, ``dp_cp``); None without one, or on one process."""
        return self.strategy.device_mesh

    def maybe_context_parallel(self, buffers: list[Any] | None = None, buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[Any] | None = None) -> Any:
        """Accelerate's context manager: inside it ``buffers`` hold this rank's part of the sequence and attention
        runs as ring attention over the cp ranks (``impel.runtime.step.context_parallel``; CUDA only, refused on CPU
        naming torch's limit); a no-op without a cp dimension, so loops call it unconditionally, once per step."""
        from impel.runtime.step.context_parallel import context_parallel

        pc = self.parallelism_config
        return context_parallel(self.torch_device_mesh, buffers, buffer_seq_dims, no_restore_buffers,
                                getattr(pc, "cp_handler", None))

    def _mesh_rank(self, dim: str, what: str) -> int:
        pc = self.parallelism_config
        if pc is None:
            raise RuntimeError(f"{what} parallelism is not configured; pass Accelerator(parallelism_config=...) or "
                               "launch with --parallelism_config_* flags")
        if pc._sizes[dim] == 1 or self.torch_device_mesh is None:
            return 0  # a dim of size 1 is not in the mesh: every rank is its only member
        return int(self.torch_device_mesh.get_local_rank(dim))

    @property
    def tensor_parallel_rank(self) -> int:
        return self._mesh_rank("tp", "Tensor")

    @property
    def context_parallel_rank(self) -> int:
        return self._mesh_rank("cp", "Context")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index along ``dp_replicate`` (Accelerate's meaning; 0 when it is 1)."""
        return self._mesh_rank("dp_replicate", "Data")

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._mesh_rank("dp_shard", "Shard-based data")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise NotImplementedError("pipeline parallelism is not supported (nor in Accelerate)")

    @property
    def should_save_model(self) -> bool:
        """True on every rank, as Accelerate 1.15: saving is collective (each rank writes its shards)."""
        return True

    def _data_parallel(self) -> tuple[int, int]:
        """(rank, size) over the ranks that read different batches: TP / CP ranks of one data-parallel rank share
        theirs (the whole world without a parallelism_config)."""
        pc = self.parallelism_config
        if pc is None:
            return self.process_index, self.num_processes
        return pc.data_parallel_coordinates(self.process_index)

    @staticmethod
    def verify_device_map(model: nn.Module) -> bool:
        """True when ``model`` (or a submodule) was placed with a multi-device ``hf_device_map`` (big-model
        inference), which training cannot prepare."""
        return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())
