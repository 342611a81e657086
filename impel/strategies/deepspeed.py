"""DeepSpeed ZeRO (stages 0-3, CPU/NVMe offload) behind the Strategy contract.

``prepare`` builds one ``deepspeed.initialize`` engine per model from the model, its optimizer (the user's torch
optimizer, or DeepSpeed's own from the JSON through :class:`DummyOptim`) and the JSON that
:mod:`impel.config.deepspeed_json` settled. The prepared model is the engine; the prepared optimizer wraps the engine's
torch optimizer (whose parameter groups now hold DeepSpeed's float32 master partitions), so schedulers built on
the user's optimizer keep driving the learning rate.

The training step goes through the engine: impel divides the loss by the real length of the accumulation group
(``backward(loss, scale_wrt_gas=False)``), tells the engine whether this backward ends a group
(``set_gradient_accumulation_boundary(sync_gradients)``), and ``optimizer.step()`` is ``engine.step()``, called only
at a boundary. ``clip_grad_norm_`` hands its ``max_norm`` to the engine, which clips inside ``engine.step()``.
deepspeed is imported here only, when this strategy is selected.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from impel.checkpoint.formats.deepspeed_engines import (
    load_engines,
    merge_zero_checkpoint,
    safe_loading,
    save_engines,
)
from impel.checkpoint.io.verified import Manifest
from impel.checkpoint.saving.options import DEFAULT_LOAD, DEFAULT_SAVE, LoadOptions, SaveOptions
from impel.checkpoint.saving.session import SaveSession
from impel.config import environment as env
from impel.config.deepspeed_json import (
    DummyOptim,
    DummyScheduler,
    fill_runtime,
    init_config,
)
from impel.config.run_config import ConfigError
from impel.runtime.step.precision import AutocastPrecision, Precision
from impel.strategies.base import Strategy
from impel.strategies.deepspeed_plugins import PluginConfigs

if TYPE_CHECKING:
    from impel.config.deepspeed_json import Resolved
    from impel.config.plugins import AutocastKwargs
    from impel.runtime.loaders.prepared_loader import PreparedLoader
    from impel.runtime.ranks.process import ProcessState
    from impel.runtime.step.accumulation import GradientState
    from impel.runtime.step.precision_report import DtypeField, PrecisionReport
    from impel.runtime.step.run_record import RunRecord

logger = logging.getLogger("impel")

__all__ = ["DeepSpeedStrategy", "import_deepspeed", "merge_zero_checkpoint", "safe_loading"]

INSTALL_HINT = "pip install 'impel[deepspeed]'"


def import_deepspeed(device: torch.device, local_rank: int = 0) -> Any:
    """deepspeed, imported with its accelerator matching impel's device; a clear ImportError when missing."""
    with env.deepspeed_import_environment(device.type, local_rank):
        try:
            import deepspeed
            from deepspeed.accelerator import get_accelerator
        except ImportError as exc:
            raise ImportError(f"distributed_type=DEEPSPEED needs DeepSpeed, which cannot be imported ({exc}); run "
                              f"{INSTALL_HINT} or use FSDP (--use_fsdp)") from exc
        have = get_accelerator().device_name()  # DeepSpeed resolves (and caches) its accelerator here
    _quiet_deepspeed()
    if have.split(":")[0] != device.type:
        raise ConfigError(f"deepspeed was imported with its {have!r} accelerator but impel runs on {device}; "
                          "create the Accelerator before importing deepspeed, or set DS_ACCELERATOR to match")
    return deepspeed


def _quiet_deepspeed() -> None:
    """DeepSpeed logs its whole config and every init step at INFO, and calls two c10d functions torch deprecates
    on every step: keep warnings and errors (``logging.getLogger("DeepSpeed").setLevel(logging.INFO)`` after the
    Accelerator exists brings the rest back)."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            r"is deprecated", category=FutureWarning)


class EnginePrecision(AutocastPrecision):
    """Autocast at the engine's dtype inside the prepared forward (inputs of any float dtype meet 16-bit weights);
    loss scaling, unscaling and the optimizer step belong to the engine."""

    def __init__(self, mode: str, dtype: torch.dtype, device: torch.device,
                 autocast_kwargs: AutocastKwargs | None) -> None:
        super().__init__(device, autocast_kwargs)
        self.mode = mode
        self.dtype = dtype


class DeepSpeedStrategy(Strategy):
    """ZeRO through ``deepspeed.initialize``; see the module docstring."""

    name = "DEEPSPEED"
    whole_model = False
    engine_managed = True
    scheduler_steps_per_process = False  # DeepSpeed's engine steps it once per optimizer step (as in Accelerate)

    def __init__(self, state: ProcessState, record: RunRecord, gradient_state: GradientState) -> None:
        self.deepspeed = import_deepspeed(state.device, state.local_process_index)
        self.configs = PluginConfigs(record, self._on_select)  # one settled JSON per plugin; the first is active
        super().__init__(state, record, gradient_state)
        if self.handlers.scaler is not None:
            logger.warning("GradScalerKwargs has no effect under DeepSpeed, whose engine scales fp16 losses itself; "
                           "set fp16.loss_scale / fp16.initial_scale_power in the DeepSpeed JSON instead")
        self._check_nvme()
        self.state.ensure_process_group()  # DeepSpeed needs one even for one process
        self.engines: list[Any] = []
        self.train_engine: Any = None
        self._by_optimizer: dict[int, Any] = {}  # id(given or returned optimizer) -> engine
        self._engine_configs: dict[int, Resolved] = {}  # id(engine) -> the plugin's JSON it was built with
        self._dataloaders: list[PreparedLoader] = []
        self._call_schedulers: list[object] = []
        self._load_dtypes: dict[int, DtypeField] = {}
        self._upcast = False
        self._last_boundary = True
        self._pending_clip: float | None = None
        self._pending_norm: torch.Tensor | None = None
        self._hf_config = self._register_with_transformers()

    # --- construction helpers -------------------------------------------------------------------------------
    @property
    def resolved(self) -> Resolved:
        """The active plugin's settled JSON: what the next engine is built with."""
        return self.configs.resolved

    def resolved_for(self, engine: object) -> Resolved:
        """The settled JSON ``engine`` was built with (the active plugin's for anything else)."""
        return self._engine_configs.get(id(engine), self.resolved)

    def _on_select(self) -> None:
        """Another plugin is active: transformers' ZeRO-3 detection follows it."""
        if not hasattr(self, "_hf_config"):
            return  # during construction
        self._unregister_from_transformers()
        self._hf_config = self._register_with_transformers()

    def build_precision(self) -> Precision:
        """Autocast at the engine's dtype; loss scaling and the optimizer step are the engine's (no GradScaler)."""
        if self.resolved.dtype != torch.float32:
            return EnginePrecision(self.config.mixed_precision, self.resolved.dtype, self.device,
                                   self.handlers.autocast)
        return Precision(self.device, self.handlers.autocast)

    def _check_nvme(self) -> None:
        from deepspeed.accelerator import get_accelerator

        for what in ("optimizer", "param"):
            if all(resolved.offload(what) != "nvme" for resolved in self.configs.all_resolved()):
                continue
            builder = get_accelerator().create_op_builder("AsyncIOBuilder")
            if builder is None or not builder.is_compatible(verbose=False):
                raise ConfigError(
                    f"offload_{what}_device='nvme' needs DeepSpeed's async I/O op (async_io), which cannot be built "
                    "on this machine: the libaio library and headers were not found. Install them (Debian/Ubuntu: "
                    f"apt-get install libaio-dev) and retry, or set offload_{what}_device to 'cpu'")

    def _register_with_transformers(self) -> _Zero3Announcement | None:
        """With zero3_init_flag, transformers' ``from_pretrained`` loads straight into ZeRO-3 partitions when it
        can see the config (the Accelerator must exist before ``from_pretrained``)."""
        if not (self.resolved.stage == 3 and self.resolved.zero3_init):
            return None
        if importlib.util.find_spec("transformers") is None:
            return None
        from transformers.integrations import deepspeed as hf_deepspeed

        handle = _Zero3Announcement(init_config(self.resolved))
        hf_deepspeed.set_hf_deepspeed_config(handle)  # transformers keeps a weak reference; we keep the object
        return handle

    # --- wrapping -------------------------------------------------------------------------------------------
    def init_context(self) -> contextlib.AbstractContextManager[object]:
        if not (self.resolved.stage == 3 and self.resolved.zero3_init):
            return contextlib.nullcontext()
        # mem_efficient_linear=False: DeepSpeed's default replaces torch.nn.functional.linear for the whole process,
        # for good ("This will persist unless manually reset"), which would reach every other model.
        # dtype=None: the config's bf16/fp16 sections say it (resolved.dtype came from them). Given explicitly,
        # DeepSpeed 0.19.8 ignores it where the accelerator has no fp16 (``dtype or fp16 if fp16_ok else bf16 if ...``
        # binds the conditional first): a CPU without fp16 then built an fp32 run's parameters in bf16.
        return self.deepspeed.zero.Init(config_dict_or_path=init_config(self.resolved), dtype=None,
                                        mem_efficient_linear=False)

    def before_setup(self, dataloaders: Sequence[PreparedLoader], schedulers: Sequence[object]) -> None:
        self._dataloaders = list(dataloaders)
        self._call_schedulers = list(schedulers)

    def setup(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              device_placement: Sequence[bool]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        owners = self._pair(models, optimizers)
        engines = []
        for index, (model, place) in enumerate(zip(models, device_placement)):
            mine = [opt for opt, owner in zip(optimizers, owners) if owner == index]
            engines.append(self._build_engine(model, mine[0] if mine else None, place))
        returned = [self._by_optimizer[id(opt)].basic_optimizer for opt in optimizers]
        return engines, returned

    def _pair(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> list[int]:
        """For each optimizer, the index of the model (in this call) that owns its parameters."""
        if optimizers and not models:
            raise ConfigError("DeepSpeed builds one engine from a model and its optimizer: pass the model to the same "
                              "prepare() call as its optimizer")
        if len(optimizers) + (self.train_engine is not None) > 1:
            raise ConfigError("DeepSpeed trains one model with one optimizer per Accelerator (one engine); prepare() "
                              f"got {len(optimizers)} optimizer(s) after {len(self.engines)} engine(s) were built")
        from impel.runtime.step.optimizer import optimizer_owners

        owners: list[int] = []
        for opt, owner in zip(optimizers, optimizer_owners(models, optimizers)):
            if owner is None:
                raise ConfigError(f"the optimizer {type(opt).__name__} passed to prepare() updates parameters that "
                                  "no model in the same call owns; pass the model and its optimizer together")
            owners.append(owner)
        return owners

    def _build_engine(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, place: bool) -> Any:
        from impel.runtime.step.precision_report import dtype_of

        if not place:
            logger.warning("device_placement=False has no effect under DeepSpeed: its engine places %s on %s",
                           type(model).__name__, self.device)
        self._load_dtypes[id(model)] = dtype_of(model.parameters())
        self._match_precision(model)
        scheduler = next((s for s in self._call_schedulers if getattr(s, "optimizer", None) is optimizer
                          and optimizer is not None), None)
        cfg = fill_runtime(self.configs.base_for(), micro_batch=self._micro_batch(), world=self.state.num_processes,
                           optimizer=optimizer, scheduler=scheduler, has_optimizer=optimizer is not None,
                           model=model)
        if optimizer is not None:  # an engine without optimizer (a frozen reference model) never accumulates
            self._check_accumulation(cfg)
        kwargs: dict[str, object] = {"model": model, "config": cfg}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        engine, *_ = self.deepspeed.initialize(**kwargs)
        self.configs.publish(cfg)  # plugin.deepspeed_config: the concrete JSON, as Accelerate fills it at prepare
        self._engine_configs[id(engine)] = self.resolved
        self._load_dtypes[id(engine)] = self._load_dtypes.pop(id(model))
        self.engines.append(engine)
        if optimizer is not None:
            self.train_engine = engine
            self._by_optimizer[id(optimizer)] = engine
            self._by_optimizer[id(engine.basic_optimizer)] = engine
        return engine

    def _match_precision(self, model: nn.Module) -> None:
        """fp32 DeepSpeed runs on fp32 parameters: a model loaded in 16 bits is upcast here (DeepSpeed's own
        bf16/fp16 modes cast the module themselves and keep fp32 masters in the optimizer)."""
        if self.resolved.dtype != torch.float32 or any(hasattr(p, "ds_id") for p in model.parameters()):
            return
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            model.to(torch.float32)
            self._upcast = True

    def _micro_batch(self) -> int | None:
        sizes = [size for dl in self._dataloaders if (size := dl.batch_size)]
        if not sizes:
            return None
        plugin = self.configs.plugin
        return min(sizes) if plugin is None or plugin.is_train_batch_min else max(sizes)

    def _check_accumulation(self, cfg: Mapping[str, object]) -> None:
        gs = self.gradient_state
        if gs is None:
            return
        if gs.num_steps != cfg["gradient_accumulation_steps"]:
            raise ConfigError(f"the Accelerator accumulates {gs.num_steps} micro-steps but the DeepSpeed config says "
                              f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']}; set one value")
        if gs.plugin.sync_each_batch and self.resolved.stage < 2:
            raise ConfigError(f"GradientAccumulationPlugin(sync_each_batch=True) has no DeepSpeed equivalent at ZeRO "
                              f"stage {self.resolved.stage}; use ZeRO-2/3 (which reduce gradients on every micro-step "
                              "anyway) or drop sync_each_batch")

    def resolve_scheduler(self, scheduler: object) -> object:
        if not isinstance(scheduler, DummyScheduler):
            if isinstance(getattr(scheduler, "optimizer", None), DummyOptim):
                raise ConfigError(f"{type(scheduler).__name__} was built on a DummyOptim, which never steps; build "
                                  "it on the optimizer prepare() returned, or use DummyScheduler")
            return scheduler
        engine = self._by_optimizer.get(id(scheduler.optimizer))
        if engine is None:
            raise ConfigError("a DummyScheduler must be prepared with (or after) its optimizer: pass both to the same "
                              "prepare() call")
        built = engine.lr_scheduler
        if built is None:
            raise ConfigError("the DeepSpeed engine built no scheduler for this DummyScheduler; define a \"scheduler\" "
                              "in the DeepSpeed JSON or pass DummyScheduler(lr_scheduler_callable=...)")
        engine.lr_scheduler = None  # impel's prepared scheduler steps it: once per real optimizer step
        return built

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, self.deepspeed.DeepSpeedEngine) else model

    # --- the training step ----------------------------------------------------------------------------------
    def _engine(self) -> Any:
        if self.train_engine is None:
            raise ConfigError("no DeepSpeed engine with an optimizer yet: prepare the model and its optimizer "
                              "together before backward()")
        return self.train_engine

    def _engine_for(self, optimizer: torch.optim.Optimizer) -> Any:
        engine = self._by_optimizer.get(id(optimizer))
        return self._engine() if engine is None else engine

    def _boundary(self) -> bool:
        gs = self.gradient_state
        return True if gs is None else bool(gs.sync_gradients and not gs.manual_no_sync)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engine = self._engine()
        boundary = self._boundary()
        engine.set_gradient_accumulation_boundary(boundary)
        self._last_boundary = boundary
        if kwargs.pop("scale_wrt_gas", False):  # False is what impel passes anyway (transformers' Trainer passes it)
            raise ConfigError("backward(loss, scale_wrt_gas=True) under impel's DeepSpeed: impel divides the loss by "
                              "the accumulation group's length itself; drop scale_wrt_gas")
        engine.backward(loss, scale_wrt_gas=False, **kwargs)  # impel already divided by the group's real length

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        return None  # the engine unscales fp16 gradients inside its step

    def _plain_gradients(self, engine: Any) -> bool:
        """Stage 0 in fp32: gradients live in ``param.grad`` (all-reduced at the boundary), no DeepSpeed wrapper."""
        return engine.optimizer is engine.basic_optimizer and not engine.zero_optimization()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float,
                        optimizers: Sequence[torch.optim.Optimizer]) -> torch.Tensor:
        """Clip at ``max_norm`` over all the engine's parameters. With ZeRO the gradients live in DeepSpeed's
        partitions and the engine computes the norm inside ``optimizer.step()``: the returned tensor is filled then
        (NaN until the step runs)."""
        engine = self._engine()
        if float(norm_type) != 2.0:
            raise ConfigError(f"clip_grad_norm_(norm_type={norm_type}) is not available under DeepSpeed, which clips "
                              "by the 2-norm; use norm_type=2")
        configured = self.resolved_for(engine).clipping
        if configured > 0 and not math.isclose(configured, float(max_norm)):
            raise ConfigError(f"clip_grad_norm_(max_norm={max_norm}) contradicts gradient_clipping={configured} in "
                              f"{self.resolved_for(engine).source}, which the engine applies every step; pass max_norm="
                              f"{configured} or set gradient_clipping to {max_norm} (or to \"auto\"/0)")
        if self._plain_gradients(engine):
            params = [p for p in engine.module.parameters() if p.grad is not None]
            if configured > 0:  # the engine clips inside step(); only report the norm
                return torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            return torch.nn.utils.clip_grad_norm_(params, float(max_norm))
        if configured == 0:
            self._pending_clip = float(max_norm)
        self._pending_norm = torch.full((), float("nan"))
        return self._pending_norm

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float,
                         optimizers: Sequence[torch.optim.Optimizer]) -> None:
        engine = self._engine()
        if not self._plain_gradients(engine):
            raise ConfigError("clip_grad_value_ is not available under DeepSpeed ZeRO or its 16-bit modes (the "
                              "gradients live in the engine's partitions); use clip_grad_norm_ or gradient_clipping")
        torch.nn.utils.clip_grad_value_([p for p in engine.module.parameters() if p.grad is not None], clip_value)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], object] | None = None) -> bool:
        engine = self._engine_for(optimizer)
        if closure is not None:
            raise ConfigError("optimizer.step(closure) is not available under DeepSpeed (engine.step() takes no "
                              "closure); compute the loss and call accelerator.backward(loss) before step()")
        if not self._last_boundary:
            raise ConfigError("optimizer.step() after a backward that did not end an accumulation group (inside "
                              "accelerator.no_sync()): DeepSpeed steps only at a boundary; accumulate with "
                              "gradient_accumulation_steps / accelerator.accumulate() instead of no_sync()")
        with self._clipping(engine):
            engine.step()
        return bool(engine.was_step_applied())

    @contextlib.contextmanager
    def _clipping(self, engine: Any) -> Iterator[None]:
        """Apply a pending ``clip_grad_norm_`` to this one step and fill the norm it returned."""
        clip, norm = self._pending_clip, self._pending_norm
        self._pending_clip = self._pending_norm = None
        target = engine.optimizer
        if clip is not None:
            target.clip_grad = clip
        try:
            yield
        finally:
            if clip is not None:
                target.clip_grad = 0.0
        if norm is not None:
            value = engine.get_global_grad_norm()
            norm.fill_(float("nan") if value is None else float(value))

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        self._engine_for(optimizer).optimizer.zero_grad(set_to_none=set_to_none)

    # --- state ----------------------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The module's weights as the engine computes with them (16-bit under bf16/fp16). ZeRO-3 gathers them on
        rank 0 (an empty dict elsewhere) and only with ``zero3_save_16bit_model``."""
        if not isinstance(model, self.deepspeed.DeepSpeedEngine):
            return super().model_state_dict(model)
        if model.zero_optimization_partition_weights():
            if not self.resolved_for(model).save_16bit:
                raise ConfigError("under ZeRO-3 the weights are partitioned; set zero3_save_16bit_model=True to "
                                  "gather them for save_model/get_state_dict, or save_state() and export full "
                                  "float32 weights with impel.merge_weights")
            state = model._zero3_consolidated_16bit_state_dict()
            return dict(state) if state is not None else {}
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    def save_checkpoint(self, session: SaveSession, models: Sequence[nn.Module],
                        optimizers: Sequence[torch.optim.Optimizer], *, safe_serialization: bool,
                        skip_models: Set[int] = frozenset(),
                        options: SaveOptions = DEFAULT_SAVE) -> Mapping[str, object]:
        """Each engine's own checkpoint (its ZeRO partitions, written by every rank): checkpoint/deepspeed_engines."""
        trained = {i for i, m in enumerate(models) if any(m is e for e in self._by_optimizer.values())}
        return save_engines(models, session.checkpoint_dir, stages=[self.resolved_for(m).stage for m in models],
                            trained=trained, world=self.state.num_processes,
                            dtype=self.resolved.dtype, engine_kwargs=options.engine_kwargs)

    def load_checkpoint(self, manifest: Manifest | None, models: Sequence[nn.Module],
                        optimizers: Sequence[torch.optim.Optimizer], directory: Path, metadata: Mapping[str, Any], *,
                        skip_models: Set[int] = frozenset(), options: LoadOptions = DEFAULT_LOAD) -> None:
        load_engines(models, directory, metadata, skip_models, stages=[self.resolved_for(m).stage for m in models],
                     world=self.state.num_processes, engine_kwargs=options.engine_kwargs)

    def precision_report(self, models: Sequence[nn.Module],
                         optimizers: Sequence[torch.optim.Optimizer]) -> PrecisionReport:
        from impel.strategies.deepspeed_report import engine_report

        return engine_report(self, models, optimizers)

    def teardown(self) -> None:
        self._unregister_from_transformers()
        env.release_deepspeed_environment()

    def _unregister_from_transformers(self) -> None:
        if self._hf_config is not None and importlib.util.find_spec("transformers") is not None:
            from transformers.integrations import deepspeed as hf_deepspeed

            hf_deepspeed.unset_hf_deepspeed_config()
            self._hf_config = None


class _Zero3Announcement:
    """What transformers' ``is_deepspeed_zero3_enabled()`` / ``deepspeed_config()`` read (the part of its
    HfDeepSpeedConfig they use), without needing accelerate installed."""

    def __init__(self, config: dict[str, object]) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return True
