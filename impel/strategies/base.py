"""The Strategy contract: every difference between single device, DDP, FSDP2 and DeepSpeed lives behind it.

The Accelerator (the facade) only calls these methods; it never asks which strategy it holds. A strategy owns
the precision object, wraps models and optimizers (together, because FSDP2 replaces parameters and DeepSpeed
builds an engine from both), switches gradient synchronisation for accumulation, runs backward, clips, steps,
produces full state dicts and reads and writes the model/optimizer part of checkpoints (its own format). New
strategies register a dotted path in ``REGISTRY``; the facade is untouched.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from impel.checkpoint.io.verified import Manifest
from impel.checkpoint.saving.options import DEFAULT_LOAD, DEFAULT_SAVE, LoadOptions, SaveOptions
from impel.checkpoint.saving.session import SaveSession
from impel.config.run_config import ConfigError
from impel.runtime.step.precision import Precision, make_precision
from impel.strategies.fsdp_loading import ParamReplacements
from impel.strategies.tensor_parallel import check_user_plan, clip_by_total_norm, has_dtensor, is_dtensor, parallelize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from impel.runtime.loaders.prepared_loader import PreparedLoader
    from impel.runtime.ranks.process import ProcessState
    from impel.runtime.step.accumulation import GradientState
    from impel.runtime.step.precision_report import PrecisionReport
    from impel.runtime.step.run_record import RunRecord

REGISTRY: dict[str, str] = {
    "NO": "impel.strategies.single:SingleDeviceStrategy",
    "MULTI_CPU": "impel.strategies.ddp:DDPStrategy",
    "MULTI_GPU": "impel.strategies.ddp:DDPStrategy",
    "FSDP": "impel.strategies.fsdp:FSDPStrategy",
    "DEEPSPEED": "impel.strategies.deepspeed:DeepSpeedStrategy",
}


class Strategy:
    """Base strategy: a model on one device, plain backward, local optimizer step."""

    name = "NO"
    # Accelerate steps a prepared scheduler once per process per optimizer step (each rank consumed a batch), except
    # under DeepSpeed, whose engine owns the scheduler and steps it once: the prepared scheduler follows suit.
    scheduler_steps_per_process = True
    # What this strategy is, asked by the faces instead of its name (a new strategy sets what applies to it):
    whole_model = True  # every rank holds the whole model (LocalSGD averages it)
    uses_ddp = False  # torch's DistributedDataParallel reduces the gradients (DDP kwargs and comm hooks, Join)
    engine_managed = False  # an engine owns the optimizer step, the accumulation count and its own checkpoint files
    fsdp2 = False  # FSDP2 shards the parameters (Accelerate's is_fsdp2); torch.compile runs per block, in the strategy
    def __init__(self, state: ProcessState, record: RunRecord, gradient_state: GradientState) -> None:
        self.state = state
        self.record = record
        self.config = record.config
        self.handlers = record.handlers
        self.gradient_state = gradient_state  # the Accelerator's (DeepSpeed's engine needs the group boundary)
        self.device: torch.device = state.device
        self.precision: Precision = self.build_precision()
        # N-D parallelism: the mesh of the settled ParallelismConfig (None without one, or on one process)
        self.parallelism = record.parallelism
        self.device_mesh: DeviceMesh | None = (self.parallelism.get_device_mesh(self.device.type) if self.parallelism
                                               else None)
        self.replacements = ParamReplacements()  # parameters TP / FSDP replaced, to re-point optimizers

    def build_precision(self) -> Precision:
        """The precision this strategy runs at (built once, by the constructor): autocast and GradScaler from the
        run's ``mixed_precision``; a strategy whose engine owns them overrides this."""
        return make_precision(self.config.mixed_precision, self.device, self.handlers.autocast, self.handlers.scaler)

    # --- wrapping -------------------------------------------------------------------------------------------
    def init_context(self) -> contextlib.AbstractContextManager[object]:
        """Build models inside this context to have them created the strategy's way (ZeRO-3 partitions them)."""
        return contextlib.nullcontext()

    def before_setup(self, dataloaders: Sequence[PreparedLoader], schedulers: Sequence[object]) -> None:
        """Called by ``prepare`` before ``setup`` with every dataloader prepared so far and this call's raw
        schedulers (DeepSpeed sizes its batch and fills its JSON's "auto" values from them)."""
        return

    def resolve_scheduler(self, scheduler: object) -> object:
        """The scheduler ``prepare`` wraps (DeepSpeed swaps a DummyScheduler for the one its engine built)."""
        return scheduler

    def setup(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              device_placement: Sequence[bool]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Wrap the models and optimizers handed to one ``prepare`` call; return them in the same order.

        ``device_placement[i]`` says whether model i is moved to the device.
        """
        wrapped = [self.wrap_model(m, place) for m, place in zip(models, device_placement)]
        self.apply_tensor_parallel(wrapped)  # tp_size > 1 (no DDP wrapper then: the world is tensor parallel)
        return wrapped, [self.wrap_optimizer(o) for o in optimizers]

    def apply_tensor_parallel(self, models: Sequence[nn.Module]) -> None:
        """Split each model over the mesh's ``tp`` dim by its plan (:mod:`.tensor_parallel`); a no-op unless
        ``tp_size > 1``."""
        pc = self.parallelism
        if pc is None or not pc.tp_enabled or not models:
            return
        plan = pc.tp_handler.tp_plan if pc.tp_handler is not None else None
        matched: set[str] = set()
        for model in models:
            matched |= parallelize(model, pc.submesh("tp"), plan, self.replacements)
        check_user_plan(plan, matched, models)

    def wrap_model(self, model: nn.Module, device_placement: bool) -> nn.Module:
        if device_placement:
            model = model.to(self.device)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.replacements.repoint(optimizer)  # onto the DTensor parameters tensor parallelism put in place
        return optimizer

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module without any distributed wrapper."""
        return model

    # --- mixed precision, as the facade and the checkpoints see it ------------------------------------------
    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's GradScaler, else None."""
        return self.precision.scaler

    def forward_autocast(self) -> Callable[[], contextlib.AbstractContextManager[object]] | None:
        """What the prepared forward enters (autocast to the mixed-precision dtype); None without mixed precision."""
        return self.precision.autocast if self.precision.dtype is not None else None

    def autocast(self, enabled: bool | None = None) -> contextlib.AbstractContextManager[object]:
        """``accelerator.autocast()``: the mixed-precision autocast, or nothing without mixed precision."""
        return self.precision.autocast(enabled) if self.precision.dtype is not None else contextlib.nullcontext()

    def precision_state_dict(self) -> dict[str, object]:
        """The loss scaler's state (empty without fp16), saved in the checkpoint's training state."""
        return self.precision.state_dict()

    def load_precision_state_dict(self, state: dict[str, object]) -> None:
        self.precision.load_state_dict(state)

    # --- the training step ----------------------------------------------------------------------------------
    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        """Turn the cross-rank gradient reduction of the next backward on or off (accumulation)."""
        return

    def forced_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """``trigger_sync_in_backward``: a block whose backward reduces gradients even inside ``no_sync``."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if type(self.precision).backward is Precision.backward:  # plain: one Python call less on every step
            loss.backward(**kwargs)
        else:
            self.precision.backward(loss, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.precision.unscale_(optimizer)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float,
                        optimizers: Sequence[torch.optim.Optimizer]) -> torch.Tensor:
        for opt in optimizers:
            self.unscale_gradients(opt)
        params = list(parameters)
        if not any(is_dtensor(p.grad) for p in params):
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return clip_by_total_norm(params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float,
                         optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            self.unscale_gradients(opt)
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], object] | None = None) -> bool:
        """Step; return False when the step was skipped (fp16 overflow)."""
        return self.precision.step(optimizer, closure)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def plain_optimizer_calls(self) -> bool:
        """Whether :meth:`optimizer_step` and :meth:`zero_grad` are just torch's calls (this base's, with a precision
        whose step is plain): the prepared optimizer then makes them itself, decided once when it is built."""
        return (getattr(self.optimizer_step, "__func__", None) is Strategy.optimizer_step
                and getattr(self.zero_grad, "__func__", None) is Strategy.zero_grad
                and type(self.precision).step is Precision.step)

    def precision_report(self, models: Sequence[nn.Module],
                         optimizers: Sequence[torch.optim.Optimizer]) -> PrecisionReport:
        """The dtypes in effect: stored parameters, compute, gradients, reduction, optimizer states."""
        from impel.runtime.step.precision_report import basic_report

        return basic_report(self.name, self.precision.mode, self.precision.dtype, self.state.use_distributed,
                            [self.unwrap_model(m) for m in models], optimizers)

    # --- state ----------------------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A full state dict of ordinary tensors (gathered where sharded: tensor parallel DTensors)."""
        inner = self.unwrap_model(model)
        if not has_dtensor(inner):
            return inner.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True))
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def save_checkpoint(self, session: SaveSession, models: Sequence[nn.Module],
                        optimizers: Sequence[torch.optim.Optimizer], *, safe_serialization: bool,
                        skip_models: Set[int] = frozenset(),
                        options: SaveOptions = DEFAULT_SAVE) -> Mapping[str, object]:
        """Write model and optimizer state into ``session.directory`` through ``session``'s writers (called on
        every rank, inside ``save_state``; an asynchronous save's session stages the writes).

        ``session.leader``: this rank writes replicated files (rank 0, or each node's first with save_on_each_node).
        ``skip_models``: indices a save pre-hook took over. Returns the JSON-able ``strategy`` section of the
        checkpoint metadata; it must hold ``format`` (the key ``merge_weights`` dispatches on) and ``models``.
        Base (single device, DDP): full ``model*.safetensors`` and ``optimizer*.pt`` written by the writer.
        """
        if any(has_dtensor(self.unwrap_model(m)) for m in models):  # tensor parallel: every rank its shards, DCP
            from impel.checkpoint.formats.sharded import save_sharded

            return save_sharded(session, models, optimizers, skip_models=skip_models)
        from impel.checkpoint.formats.full import save_full

        return save_full(session, models, optimizers, safe_serialization=safe_serialization,
                         skip_models=skip_models)

    def load_checkpoint(self, manifest: Manifest | None, models: Sequence[nn.Module],
                        optimizers: Sequence[torch.optim.Optimizer], directory: Path, metadata: Mapping[str, Any], *,
                        skip_models: Set[int] = frozenset(), options: LoadOptions = DEFAULT_LOAD) -> None:
        """Load what ``save_checkpoint`` wrote (``metadata`` is its returned section), on every rank; impel's
        readers check each file against ``manifest`` as they read it (None: a directory without one).

        Base: full files, or a sharded (DCP) checkpoint from FSDP, which DCP reads into full tensors on every rank.
        ``options.strict``: whether the models' keys must match the files exactly.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        from impel.checkpoint.formats import full, sharded

        state_options = StateDictOptions(strict=options.strict)
        if metadata.get("format") == sharded.FORMAT:
            sharded.load_sharded(manifest, models, optimizers, directory, metadata, skip_models=skip_models,
                                 options=state_options)
        else:  # full files into DTensor (tensor-parallel) parameters: each rank keeps its slice
            split = any(has_dtensor(self.unwrap_model(m)) for m in models)
            full.load_full(manifest, models, optimizers, directory, metadata, skip_models=skip_models,
                           options=StateDictOptions(strict=options.strict, full_state_dict=split))

    def teardown(self) -> None:
        return None


def load_strategy(record: RunRecord, state: ProcessState, gradient_state: GradientState) -> Strategy:
    """Build the strategy ``record.distributed_type`` names, from the resolved record."""
    return strategy_class(record.distributed_type)(state, record, gradient_state)


def strategy_class(distributed_type: str) -> type[Strategy]:
    """The class of the strategy ``distributed_type`` names (its capabilities can be read before it is built)."""
    if distributed_type == "AUTO":
        raise ConfigError("distributed_type='AUTO' is resolved by impel launch from a memory estimate; run the script "
                          "with `impel launch --strategy auto --auto_model MODEL` or set a concrete distributed_type")
    try:
        target = REGISTRY[distributed_type]
    except KeyError:
        raise ValueError(f"distributed_type={distributed_type!r} has no strategy; use one of "
                         f"{sorted(REGISTRY)}") from None
    module_name, _, cls_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls: type[Strategy] = getattr(module, cls_name)
    return cls
