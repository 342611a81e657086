"""FSDP2: ``fully_shard`` over a ``DeviceMesh``, configured with FSDP1's / Accelerate's option names.

How each option maps (docs/design.md, "FSDP2", has the full table):

- sharding_strategy: FULL_SHARD / SHARD_GRAD_OP shard over a 1-D mesh with reshard_after_forward True / False;
  HYBRID_SHARD / HYBRID_SHARD_ZERO2 use a 2-D (nodes x ranks per node) mesh, replicated across nodes and sharded
  within one; NO_SHARD is a (world x 1) mesh: pure replication, gradients all-reduced.
- offload_params: ``CPUOffloadPolicy``. Mixed precision: ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``
  over fp32 shards (bf16/fp16-loaded parameters are upcast before sharding), plus autocast.
- auto_wrap_policy: :mod:`.fsdp_wrap`. cpu_ram_efficient_loading / sync_module_states: :mod:`.fsdp_loading`.
- forward_prefetch: each unit explicitly prefetches the next one's all-gather (FSDP2 otherwise overlaps it
  implicitly). backward_prefetch: BACKWARD_PRE is FSDP2's own behaviour; NO_PREFETCH prefetches nothing;
  BACKWARD_POST does not exist in FSDP2 and runs as BACKWARD_PRE (a warning says so).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from impel.checkpoint.io.verified import Manifest
from impel.checkpoint.saving.options import DEFAULT_LOAD, DEFAULT_SAVE, LoadOptions, SaveOptions
from impel.checkpoint.saving.session import SaveSession
from impel.config import environment as env
from impel.config.run_config import ConfigError, reshards_after_forward
from impel.runtime.step.compile import Compiler
from impel.runtime.step.precision_report import (
    PrecisionReport,
    dtype_of,
    optimizer_state_dtype,
    predicted_state_dtype,
)
from impel.strategies.base import Strategy
from impel.strategies.fsdp_loading import (
    ParamReplacements,
    agree_on_meta,
    broadcast_from_rank0,
    materialize,
    rank0_state,
    upcast_low_precision,
)
from impel.strategies.fsdp_pretrained import guard_save_pretrained
from impel.strategies.fsdp_wrap import check_requested, checkpoint_units, select_units
from impel.strategies.tensor_parallel import clip_by_total_norm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

    from impel.runtime.ranks.process import ProcessState
    from impel.runtime.step.accumulation import GradientState
    from impel.runtime.step.run_record import RunRecord

logger = logging.getLogger("impel")


def mesh_layout(strategy: str, world: int, local_world: int) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """The DeviceMesh shape and dim names for a sharding strategy. Full sharding uses torch's default mesh (every
    rank, no dim names), the one ``fully_shard`` builds without a mesh, as under Accelerate: a model a library shards
    itself that way (TRL's reference model) then shares the policy's mesh, so ops between their DTensors (TRL's
    ``sync_ref_model`` mixing the policy into the reference model) run."""
    if strategy == "NO_SHARD":
        return (world, 1), ("replicate", "shard")
    if strategy.startswith("HYBRID"):
        if local_world < 1 or world % local_world:
            raise ConfigError(f"fsdp_sharding_strategy={strategy!r} needs the same number of ranks on every node, "
                              f"but WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
        return (world // local_world, local_world), ("replicate", "shard")
    return (world,), None


class FSDPStrategy(Strategy):
    """Shards every prepared model with FSDP2 and re-points its optimizers at the shards."""

    name = "FSDP"
    whole_model = False
    fsdp2 = True

    def __init__(self, state: ProcessState, record: RunRecord, gradient_state: GradientState) -> None:
        super().__init__(state, record, gradient_state)
        self.fsdp = self.config.fsdp
        self.compiler = Compiler(record.dynamo_plugin, per_block=True)  # torch.compile per block, before sharding
        self.sharding_strategy = self.fsdp.resolved_sharding_strategy
        self._mesh: DeviceMesh | None = None
        self._upcast = False
        state.ensure_process_group()  # one process: FSDP2 still needs a (1-rank) process group
        if self.fsdp.cpu_ram_efficient_loading:
            env.announce_fsdp_ram_efficient_loading()
        if self.fsdp.backward_prefetch == "BACKWARD_POST":
            logger.warning("fsdp_backward_prefetch='BACKWARD_POST' has no FSDP2 equivalent; FSDP2 prefetches the "
                           "previous unit before each unit's gradient computation (BACKWARD_PRE). Set BACKWARD_PRE "
                           "(or NO_PREFETCH) to silence this")
        self.mp_policy, self.offload_policy = self._policies()
        self._publish_policies(record.plugins.fsdp)

    def _publish_policies(self, plugin: Any) -> None:
        """The plugin in effect (``accelerator.state.fsdp_plugin``) holds torch's objects this strategy shards with,
        as Accelerate's FSDP2 plugin does: libraries that shard more models themselves (TRL's ``prepare_fsdp`` for
        reference models) pass them to ``fully_shard``. ``mixed_precision_policy`` is None without mixed precision."""
        if plugin is None:
            return
        plugin.mixed_precision_policy = self.mp_policy if self.precision.dtype is not None else None
        plugin.cpu_offload = self.offload_policy
        plugin.reshard_after_forward = reshards_after_forward(self.sharding_strategy)

    def _policies(self) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
        )

        dtype = self.precision.dtype
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        offload = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.fsdp.offload_params
                   else OffloadPolicy())
        return mp, offload

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: the parallelism config's ``dp_shard`` x ``cp`` (with ``dp_replicate`` first:
        HSDP), else the sharding strategy's own."""
        if self._mesh is None and self.parallelism is not None and self.device_mesh is not None:
            self._mesh = self.parallelism.submesh(*self.parallelism.fsdp_mesh_dim_names)
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            topo = self.state.topology
            shape, names = mesh_layout(self.sharding_strategy, dist.get_world_size(),
                                       topo.local_world_size if topo.distributed else 1)
            self._mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._mesh

    # --- wrapping ---------------------------------------------------------------------------------------------
    def init_context(self) -> contextlib.AbstractContextManager[object]:
        """With cpu_ram_efficient_loading, models built inside are on the meta device on every rank but 0 (rank 0
        builds real weights, which prepare broadcasts); otherwise a no-op."""
        if self.fsdp.cpu_ram_efficient_loading and dist.get_rank() != 0:
            return torch.device("meta")
        return contextlib.nullcontext()

    def setup(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              device_placement: Sequence[bool]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Shard each model (units chosen for all of them first, so a bad layer name fails before any work)."""
        plans = [select_units(m, self.fsdp) for m in models]
        matched: set[str] = set().union(*(names for _, names in plans)) if plans else set()
        check_requested(self.fsdp.transformer_layer_cls_to_wrap, list(models), matched)
        if self.parallelism is not None and self.parallelism.tp_enabled and self.fsdp.cpu_ram_efficient_loading:
            raise ConfigError("fsdp_cpu_ram_efficient_loading is not supported with tp_size > 1 yet (tensor "
                              "parallelism splits real weights); build the model with real weights on every rank, or "
                              "load it split with transformers' from_pretrained(tp_plan=...)")
        if not all(device_placement) and self.device.type != "cpu":
            logger.warning("device_placement=False has no effect under FSDP: fully_shard places the shards on %s",
                           self.device)
        wrapped = [self._shard(model, units) for model, (units, _) in zip(models, plans)]
        for optimizer in optimizers:
            self.replacements.repoint(optimizer)
        return wrapped, list(optimizers)

    def _shard(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, FSDPModule):  # the user already called fully_shard: keep their layout
            logger.info("FSDP: %s is already sharded (fully_shard); prepare uses it as is", type(model).__name__)
            return model
        sync = self.fsdp.sync_module_states or self.fsdp.cpu_ram_efficient_loading
        on_meta = agree_on_meta(model, sync, self.device)
        if self.precision.dtype is not None and any(p.dtype in (torch.bfloat16, torch.float16)
                                                    for p in model.parameters()):
            upcast_low_precision(model)
            self._upcast = True
        full_state = rank0_state(model, dist.get_rank()) if sync else {}
        owners = ParamReplacements.owners(model)  # before TP and FSDP replace them: optimizers hold these
        self.apply_tensor_parallel([model])  # 2-D / 3-D: tensor parallel first, then FSDP over dp_shard_cp
        if self.fsdp.activation_checkpointing:
            units = checkpoint_units(model, units)
        self.compiler.before_shard(model)  # torch.compile per block, before sharding (as torchtitan)
        options: dict[str, Any] = {"mesh": self.mesh,  # fully_shard's keywords, each of its own type
                                   "reshard_after_forward": reshards_after_forward(self.sharding_strategy),
                                   "mp_policy": self.mp_policy, "offload_policy": self.offload_policy}
        sharded_units = [fully_shard(unit, **options) for unit in units]  # each returns its module, now an FSDPModule
        sharded_root = fully_shard(model, **options)
        if on_meta:
            materialize(model, self.device, shards_on_cpu=self.fsdp.offload_params)
        if sync:
            broadcast_from_rank0(model, full_state)
        del full_state
        self.replacements.record(owners)
        self._set_prefetch(sharded_root, sharded_units)
        guard_save_pretrained(model)  # PEFT / transformers: state_dict= or a named error, not safetensors' one
        return model

    def _set_prefetch(self, root: FSDPModule, units: list[FSDPModule]) -> None:
        if self.fsdp.forward_prefetch:
            for current, following in itertools.pairwise(units):
                current.set_modules_to_forward_prefetch([following])
        if self.fsdp.backward_prefetch == "NO_PREFETCH":
            # an explicit list replaces FSDP2's default prefetch; a unit "prefetching" itself (already gathered
            # when its backward starts) is a no-op, so nothing is fetched ahead
            for unit in [*units, root]:
                unit.set_modules_to_backward_prefetch([unit])

    # --- the training step ------------------------------------------------------------------------------------
    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float,
                        optimizers: Sequence[torch.optim.Optimizer]) -> torch.Tensor:
        """Clip by the norm over all shards (a plain tensor, equal on every rank)."""
        for opt in optimizers:
            self.unscale_gradients(opt)
        return clip_by_total_norm(parameters, max_norm, norm_type)

    # --- state ------------------------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, ordinary tensors on every rank (collective: call it on all ranks)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # torch types the values as any state-dict value; full_state_dict=True makes them ordinary tensors
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return cast(dict[str, torch.Tensor], state)

    def save_checkpoint(self, session: SaveSession, models: Sequence[nn.Module],
                        optimizers: Sequence[torch.optim.Optimizer], *, safe_serialization: bool,
                        skip_models: Set[int] = frozenset(),
                        options: SaveOptions = DEFAULT_SAVE) -> Mapping[str, object]:
        """SHARDED_STATE_DICT: every rank writes its shards (DCP). FULL_STATE_DICT: full files, each rank writing
        its shards' bytes into them (``checkpoint/formats/cooperative.py``), or gathered on rank 0 with
        save_on_each_node."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if self.fsdp.state_dict_type == "SHARDED_STATE_DICT":
            from impel.checkpoint.formats.sharded import save_sharded

            return save_sharded(session, models, optimizers, skip_models=skip_models)
        from impel.checkpoint.formats.full import save_full

        full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # one shared directory: each rank writes its shards into the full files (nothing gathered on rank 0)
        shared = options.shared_dir
        return save_full(session, models, optimizers, safe_serialization=safe_serialization,
                         skip_models=skip_models, options=full_options, all_ranks=True,
                         cooperative_rank=dist.get_rank() if shared else None)

    def load_checkpoint(self, manifest: Manifest | None, models: Sequence[nn.Module],
                        optimizers: Sequence[torch.optim.Optimizer], directory: Path, metadata: Mapping[str, Any], *,
                        skip_models: Set[int] = frozenset(), options: LoadOptions = DEFAULT_LOAD) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        from impel.checkpoint.formats import full, sharded

        strict = options.strict
        if metadata.get("format") == sharded.FORMAT:
            sharded.load_sharded(manifest, models, optimizers, directory, metadata, skip_models=skip_models,
                                 options=StateDictOptions(strict=strict))
        else:
            full.load_full(manifest, models, optimizers, directory, metadata, skip_models=skip_models,
                           options=StateDictOptions(full_state_dict=True, strict=strict), slices=True)

    def precision_report(self, models: Sequence[nn.Module],
                         optimizers: Sequence[torch.optim.Optimizer]) -> PrecisionReport:
        params = [p for m in models for p in m.parameters()]
        stored = dtype_of(params)
        grads = dtype_of(p.grad for p in params if p.grad is not None) or stored
        policy = self.mp_policy
        compute = policy.param_dtype or stored
        reduction = policy.reduce_dtype or policy.param_dtype or grads
        states = optimizer_state_dtype(optimizers) or predicted_state_dtype(optimizers)
        if self.precision.dtype is None:
            note = "no mixed precision: parameters, gradients and optimizer states keep the load dtype"
        else:
            note = (("parameters loaded in 16 bits were upcast to float32 at prepare; " if self._upcast else "")
                    + "float32 shards, 16-bit all-gathered compute, float32 reduction and optimizer step")
        return PrecisionReport(strategy=f"FSDP {self.sharding_strategy}", mixed_precision=self.precision.mode,
                               stored_params=stored, compute=compute, gradients=grads, reduction=reduction,
                               optimizer_states=states, note=note)
