"""The Accelerator: the one object a training loop talks to.

It resolves the run config (defaults < file < launch flags < these arguments), joins the process group, picks a
Strategy and forwards to it. Every difference between single device, DDP, FSDP2 and DeepSpeed is the strategy's;
accumulation bookkeeping is :mod:`impel.runtime.step.accumulation`, data sharding :mod:`impel.runtime.loaders.data`,
collectives :mod:`impel.runtime.ranks.collectives`.

Example::

    acc = Accelerator(mixed_precision="bf16")
    model, optim, loader, scheduler = acc.prepare(model, optim, loader, scheduler)
    for batch in loader:
        loss = model(**batch).loss
        acc.backward(loss)
        optim.step(); scheduler.step(); optim.zero_grad()
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from impel.accelerator import accelerate_state
from impel.accelerator.not_provided import NotProvidedMembers
from impel.accelerator.prepared import Prepared, TrainingRun
from impel.accelerator.process_methods import ProcessMethods
from impel.accelerator.resilience import Resilience
from impel.accelerator.resolve import RunArguments, accelerate_plugins, resolve
from impel.accelerator.save_load import Checkpointer
from impel.accelerator.settings import RunSettings
from impel.checkpoint.saving.options import load_options, save_options
from impel.config.ddp_hooks import refuse_hook_without_ddp
from impel.config.environment_settings import launched_settings
from impel.config.parallelism import ParallelismConfig, TorchTensorParallelPlugin
from impel.config.plugins import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    resolve_project_configuration,
)
from impel.config.run_config import ConfigError, RunConfig
from impel.runtime.loaders.data import agree_on_generator, shard_dataloader, skip_first_batches
from impel.runtime.loaders.prepared_loader import PreparedLoader
from impel.runtime.loaders.seeding import check_rng_types
from impel.runtime.ranks import rank_health
from impel.runtime.ranks.process import AcceleratorState, current_topology
from impel.runtime.step.accumulation import GradientState, MicroStep
from impel.runtime.step.compile import Compiler, TorchDynamoPlugin, uncompiled, unwrap
from impel.runtime.step.item_windows import ItemWindows
from impel.runtime.step.model_forward import ForwardContext, is_prepared, patch_forward
from impel.runtime.step.optimizer import AcceleratedOptimizer, AcceleratedScheduler
from impel.strategies.base import Strategy, load_strategy, strategy_class
from impel.trackers.registry import AcceleratorTrackers, GeneralTracker

if TYPE_CHECKING:
    from impel.config.plugins import AutocastKwargs
    from impel.runtime.step.precision_report import PrecisionReport
    from impel.types import Options

logger = logging.getLogger("impel")


class Accelerator(ProcessMethods, RunSettings, NotProvidedMembers):
    """Runs one training loop unchanged on CPU, one GPU, several GPUs or several machines."""

    def __init__(self, device_placement: bool = True, split_batches: bool | None = None,
                 mixed_precision: str | None = None, gradient_accumulation_steps: int | None = None,
                 cpu: bool | None = None, dataloader_config: DataLoaderConfiguration | None = None,
                 step_scheduler_with_optimizer: bool = True, step_scheduler_per_process: bool = True,
                 cast_outputs_to_fp32: bool = True,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 kwargs_handlers: Sequence[object] | None = None, project_dir: str | os.PathLike[str] | None = None,
                 project_config: ProjectConfiguration | None = None,
                 fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
                 deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None,
                 nonfinite_loss: str | None = None, log_with: object = None, rng_types: Sequence[str] | None = None,
                 dynamo_backend: object = None, dynamo_plugin: TorchDynamoPlugin | None = None,
                 parallelism_config: ParallelismConfig | None = None,
                 torch_tp_plugin: TorchTensorParallelPlugin | None = None, megatron_lm_plugin: object = None,
                 deepspeed_plugins: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None) -> None:
        # resolve: every value settled (launch config, these arguments, plugins, DeepSpeed JSON) before any object
        ds_plugin, ds_name, ds_others, parallelism_config = accelerate_plugins(
            deepspeed_plugin, deepspeed_plugins, torch_tp_plugin, megatron_lm_plugin, parallelism_config)
        args = RunArguments(mixed_precision=mixed_precision, cpu=cpu,
                            gradient_accumulation_steps=gradient_accumulation_steps,
                            gradient_accumulation_plugin=gradient_accumulation_plugin, nonfinite_loss=nonfinite_loss,
                            fsdp_plugin=fsdp_plugin, deepspeed_plugin=ds_plugin, deepspeed_plugin_name=ds_name,
                            more_deepspeed_plugins=ds_others,
                            dynamo_backend=dynamo_backend, dynamo_plugin=dynamo_plugin,
                            kwargs_handlers=kwargs_handlers, parallelism_config=parallelism_config)
        self.record = resolve(launched_settings(), args, current_topology())
        self.config: RunConfig = self.record.config  # read-only from here on
        self.handlers = self.record.handlers
        self.distributed_type = self.record.distributed_type
        self._tracking = AcceleratorTrackers(log_with)  # unknown or missing tracker packages raise now
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches is not None:
            self.dataloader_config.split_batches = bool(split_batches)
        self.device_placement = device_placement
        self.rng_types = check_rng_types(rng_types)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.step_scheduler_per_process = step_scheduler_per_process
        self.cast_outputs_to_fp32 = cast_outputs_to_fp32
        self.project_configuration = resolve_project_configuration(project_dir, project_config)
        self._tracking.check_logging_dir(self.project_configuration.logging_dir)
        self._warn_unused_handlers()  # build, from here: each part gets what it needs in its constructor
        init = self.handlers.init
        self.state = AcceleratorState(cpu=self.record.cpu_only, backend=init.backend if init else None,
                                      timeout=init.timeout if init else None,
                                      init_method=init.init_method if init else None, accelerator=self)
        self.gradient_state = GradientState(self.record.accumulation)
        self._micro_step = MicroStep(self.gradient_state)  # accumulate() returns it: one object, entered per micro-step
        self.strategy: Strategy = load_strategy(self.record, self.state, self.gradient_state)
        self._compiler = Compiler(self.record.dynamo_plugin, per_block=self.strategy.fsdp2)
        self._compiler.configure_backends(self.config.mixed_precision, self.device)
        self.prepared = Prepared()  # handed to the checkpointer and the resilience logic
        run = TrainingRun(self.prepared, self.strategy, self.gradient_state, self.state, self.distributed_type,
                          self.config.mixed_precision)
        self._checkpointer = Checkpointer(self.project_configuration, run, async_save=self.config.async_save,
                                          elastic=self.config.min_machines is not None)
        self._resilience = Resilience.create(self.config, self.project_configuration, run, self._checkpointer)
        accelerate_state.mirror(self)  # Accelerate's own state for TRL / PEFT helpers, when Accelerate is imported

    def _warn_unused_handlers(self) -> None:
        h = self.handlers
        if h.scaler is not None and self.config.mixed_precision != "fp16":
            logger.warning("GradScalerKwargs has no effect with mixed_precision=%r (only 'fp16' scales "
                           "gradients)", self.config.mixed_precision)
        if h.ddp is not None and not strategy_class(self.record.distributed_type).uses_ddp:
            refuse_hook_without_ddp(h.ddp, self.distributed_type)  # a comm hook under FSDP / DeepSpeed raises
            logger.warning("DistributedDataParallelKwargs has no effect with distributed_type=%r",
                           self.distributed_type)
        if h.autocast is not None and self.config.mixed_precision == "no":
            logger.warning("AutocastKwargs has no effect with mixed_precision='no'")

    # --- properties -------------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        return self.config.mixed_precision

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self.prepared.optimizers)

    # Accelerate's private lists, which some libraries read: views of the prepared record
    _models = property(attrgetter("prepared.models"), doc="list[nn.Module], Accelerate's name")
    _optimizers = property(attrgetter("prepared.optimizers"), doc="list[AcceleratedOptimizer], Accelerate's name")
    _schedulers = property(attrgetter("prepared.schedulers"), doc="list[AcceleratedScheduler], Accelerate's name")
    _dataloaders = property(attrgetter("prepared.dataloaders"), doc="list[PreparedLoader], Accelerate's name")

    @property
    def log_with(self) -> list[str | GeneralTracker]:
        """The tracker names and ``GeneralTracker`` instances asked for with ``Accelerator(log_with=...)`` (``"all"``
        expanded)."""
        return self._tracking.log_with

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.strategy.scaler

    # --- prepare ----------------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Sequence[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers, in any order; returns them in the same order
        (``None`` comes back as ``None``, as in Accelerate: ``prepare(model, optimizer, None)`` for a missing
        scheduler; any other object, a list or a tokenizer, comes back unchanged, as in Accelerate)."""
        if device_placement is not None and len(device_placement) != len(args):
            raise ConfigError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        places = list(device_placement) if device_placement is not None else [self.device_placement] * len(args)
        kinds = [self._kind(obj) for obj in args]
        result: list[Any] = list(args)
        models = [i for i, k in enumerate(kinds) if k == "model" and not is_prepared(args[i])]
        optims = [i for i, k in enumerate(kinds) if k == "optimizer" and not isinstance(args[i], AcceleratedOptimizer)]
        for i, kind in enumerate(kinds):  # dataloaders first: DeepSpeed sizes its engine from their batch size
            if kind == "dataloader" and not isinstance(args[i], PreparedLoader):
                result[i] = self.prepare_data_loader(args[i], device_placement=places[i])
        if models or optims:
            self.strategy.before_setup(self.prepared.dataloaders, [a for a, k in zip(args, kinds) if k == "scheduler"])
            wrapped_models, wrapped_optims = self.strategy.setup(
                [args[i] for i in models], [args[i] for i in optims], [places[i] for i in models])
            for i, model in zip(models, wrapped_models):
                result[i] = self._finish_model(model)
            for i, opt in zip(optims, wrapped_optims):
                result[i] = self._finish_optimizer(opt)
        for i, kind in enumerate(kinds):
            if kind == "scheduler" and not isinstance(args[i], AcceleratedScheduler):
                result[i] = self.prepare_scheduler(args[i])
        for i in (i for i, kind in enumerate(kinds) if kind not in ("none", "other")):
            result[i]._is_accelerate_prepared = True  # Accelerate's mark on what it prepared (its callers read it)
        return result[0] if len(result) == 1 else tuple(result)

    @staticmethod
    def _kind(obj: object) -> str:
        if obj is None:
            return "none"
        if isinstance(obj, nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, (DataLoader, PreparedLoader)):
            return "dataloader"
        if isinstance(obj, (LRScheduler, AcceleratedScheduler)) or (
                hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)):
            return "scheduler"
        return "other"  # anything else (a list, a tokenizer) comes back unchanged, as from Accelerate's prepare

    def _finish_model(self, model: nn.Module) -> nn.Module:
        inner = self.strategy.unwrap_model(model)
        autocast = self.strategy.forward_autocast()
        cast = autocast is not None and self.cast_outputs_to_fp32  # as Accelerate: mixed precision returns fp32
        if inner is model:
            patch_forward(model, ForwardContext(self.strategy, self.gradient_state, autocast, track=True,
                                                cast_outputs=cast))
        else:
            patch_forward(inner, ForwardContext(self.strategy, self.gradient_state, autocast, track=False))
            patch_forward(model, ForwardContext(self.strategy, self.gradient_state, None, track=True,
                                                cast_outputs=cast))
        self.prepared.models.append(model)  # uncompiled: checkpoints keep the original parameter names
        return self._compiler.prepared(model, self.strategy)

    def _finish_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(optimizer, self.strategy, self.gradient_state, guard=self._resilience)
        self.prepared.optimizers.append(wrapped)
        return wrapped

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """``evaluation_mode=True`` (transformers' evaluation) prepares the model as for training: the same outputs
        (Accelerate leaves out the DDP wrapper, which only acts in backward)."""
        return self.prepare(model, device_placement=None if device_placement is None else [device_placement])

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> AcceleratedOptimizer:
        """``device_placement`` True / None as Accelerate's (the state lives where the parameters do); False raises:
        impel keeps an optimizer's state on its parameters' device."""
        if device_placement is False:
            raise ConfigError("prepare_optimizer(device_placement=False): impel keeps the optimizer state on its "
                              "parameters' device (loading a state moves it there); leave device_placement out")
        return self.prepare(optimizer)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Callable[..., object] | None = None) -> PreparedLoader:
        """``slice_fn_for_dispatch`` cuts each rank's part of a dispatched batch (``dispatch_batches=True``); on a
        loader that is not dispatched it raises."""
        if isinstance(data_loader, PreparedLoader):
            return data_loader
        place = self.device_placement if device_placement is None else device_placement
        rank, world = self._data_parallel()  # TP / CP ranks of one data-parallel rank read the same batches
        if world == 1 and self._elastic_order():
            agree_on_generator(data_loader.sampler)  # an elastic job alone shuffles as it does on several machines
        shard = shard_dataloader(data_loader, world=world, rank=rank,
                                 device=self.device if place else None, config=self.dataloader_config,
                                 gradient_state=self.gradient_state, rng_types=self.rng_types,
                                 hooks=self._resilience, slice_fn=slice_fn_for_dispatch)
        self.prepared.dataloaders.append(shard)
        return shard

    def _elastic_order(self) -> bool:
        """An elastic job's loaders order their samples the same way on every world size (a rank alone, too,
        takes a generator drawn at prepare, as several do; Accelerate's one process draws a seed per pass)."""
        rng = ["generator"] if self.rng_types is None else self.rng_types
        return self.config.min_machines is not None and "generator" in rng \
            and not self.dataloader_config.use_seedable_sampler

    def prepare_scheduler(self, scheduler: object) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        scheduler = self.strategy.resolve_scheduler(scheduler)
        target = getattr(scheduler, "optimizer", None)
        opts = [o for o in self.prepared.optimizers if o is target or o.optimizer is target]
        # As Accelerate: N data-parallel ranks consume N batches per step, so the scheduler steps N times (scripts
        # size it so); TP / CP ranks share their batches (Accelerate 1.15 counts them too, which shortens schedules).
        per_process = (self.step_scheduler_per_process and not self.dataloader_config.split_batches
                       and self.strategy.scheduler_steps_per_process)
        wrapped = AcceleratedScheduler(scheduler, opts, self.gradient_state, self.step_scheduler_with_optimizer,
                                       self._data_parallel()[1] if per_process else 1)
        self.prepared.schedulers.append(wrapped)
        return wrapped

    # --- the training step ------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward through the strategy; divides the loss by the accumulation group's length."""
        gs = self.gradient_state
        scaled = gs.num_steps > 1 or gs.item_scale is not None
        if scaled:
            if not gs.in_micro_step:
                gs.begin_auto()
            loss = gs.scale_loss(loss)
        if self._resilience is not None:
            self._resilience.observe(loss)
        if rank_health.watching:  # the gradient all-reduce waits for the other ranks in here
            with rank_health.blocking("backward"):
                self.strategy.backward(loss, **kwargs)
        else:
            self.strategy.backward(loss, **kwargs)
        if scaled:  # otherwise no micro-step was opened (before_forward opens one only when accumulating)
            gs.end_auto()

    def item_windows(self, dataloader: Any, count: Callable[[Any], object] | None = None) -> ItemWindows:
        """impel: iterate ``dataloader`` so that ``backward`` makes token-level losses exact under accumulation and
        across ranks (each window's loss items counted on all ranks; :mod:`impel.runtime.step.item_windows`)."""
        return ItemWindows(dataloader, self.gradient_state, lambda t: self.reduce(t, "sum"), self.num_processes,
                           self.device, count)

    def accumulate(self, *models: nn.Module) -> MicroStep:
        """One micro-step: gradients sync (and the optimizer steps) only when it ends a group."""
        return self._micro_step

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip the cross-rank gradient reduction for backward passes of forwards run inside this block."""
        with self.gradient_state.no_sync_block():
            yield

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Inside ``no_sync`` / accumulation: the next backward in this block reduces gradients across ranks anyway
        (DDP; elsewhere nothing to do), as Accelerate's."""
        return self.strategy.forced_sync(uncompiled(model))

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        with self.strategy.autocast(None if autocast_handler is None else autocast_handler.enabled):
            yield

    def clip_grad_norm_(self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor | None:
        """Clip at a group boundary (gradients unscaled first) and return the total norm; None mid-group."""
        if not self.sync_gradients:
            return None
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type, self.prepared.inner_optimizers())

    def clip_grad_value_(self, parameters: Iterable[Tensor], clip_value: float) -> None:
        if self.sync_gradients:
            self.strategy.clip_grad_value_(parameters, clip_value, self.prepared.inner_optimizers())

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        targets = self.prepared.optimizers if optimizer is None else [optimizer]
        for opt in targets:
            self.strategy.unscale_gradients(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    # --- models and memory ------------------------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        return unwrap(self.strategy, model, keep_fp32_wrapper, keep_torch_compile)

    def init_context(self) -> contextlib.AbstractContextManager[object]:
        """Build models inside ``with accelerator.init_context():`` to have them created the strategy's way:
        DeepSpeed ZeRO-3 with ``zero3_init_flag`` partitions them at construction, FSDP with RAM-efficient loading
        builds them on the meta device on ranks > 0; elsewhere it does nothing."""
        return self.strategy.init_context()

    def precision_report(self, print_report: bool = False) -> PrecisionReport:
        """The dtypes in effect for the prepared models and optimizers (stored parameters, compute, gradients,
        reduction, optimizer states); ``print_report=True`` also prints it on the main process."""
        report = self.strategy.precision_report(self.prepared.models, self.prepared.inner_optimizers())
        if print_report:
            self.print(report)
        return report

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        return self.strategy.model_state_dict(uncompiled(model))

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Full weights in Hugging Face's layout (``model.safetensors`` or shards + index), from any strategy."""
        from impel.checkpoint.formats.hf import save_pretrained_weights
        from impel.checkpoint.store.ownership import refuse_inside_checkpoint

        refuse_inside_checkpoint(save_directory, "save_model save_directory")  # on every rank: none waits in vain
        state = self.get_state_dict(model)
        if self.is_main_process or (self.project_configuration.save_on_each_node and self.is_local_main_process):
            save_pretrained_weights(state, save_directory, safe_serialization, max_shard_size)
        self.wait_for_everyone()

    # --- checkpoints (impel/checkpoint/) ----------------------------------------------------------------------
    @property
    def project_dir(self) -> str | None:
        """``ProjectConfiguration.project_dir``: where ``checkpoints/checkpoint_N`` go."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """``ProjectConfiguration.logging_dir`` (defaults to ``project_dir``)."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets (restored by ``load_state``)."""
        return self.project_configuration.iteration

    @property
    def step(self) -> int:
        """Micro-steps begun since the last one that ended a dataloader (Accelerate's counter); checkpointed."""
        return self.gradient_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.gradient_state.set_step(value)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   async_save: bool | None = None, **save_model_func_kwargs: object) -> str:
        """Save everything an exact resume needs, atomically; collective (call on every rank). Returns the path.
        ``async_save=True`` returns once the state is staged in CPU memory and writes it in the background (None:
        ``ProjectConfiguration.async_save`` or the ``async_save`` config key); ``wait_for_checkpoint()``, the next
        ``save_state``/``load_state``, ``end_training`` and exit wait for it and raise its failure.
        Extra keyword arguments go to DeepSpeed's ``engine.save_checkpoint`` (elsewhere they raise)."""
        options = save_options(save_model_func_kwargs, self.strategy.engine_managed)
        return self._checkpointer.save(output_dir, safe_serialization, options, async_save=async_save)

    def wait_for_checkpoint(self) -> str | None:
        """impel: block until the pending ``save_state(async_save=True)`` is committed; returns its path (None when
        none is pending). Its failure raises here, on every rank that calls. Not collective."""
        return self._checkpointer.wait()

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: Options | None = None,
                   **load_model_func_kwargs: object) -> str:
        """Restore a ``save_state`` checkpoint (the newest complete one by default); collective. Returns the path.
        ``strict=False`` lets model keys differ; other keywords as Accelerate's (impel.checkpoint.saving.options)."""
        options = load_options(load_kwargs, load_model_func_kwargs, self.strategy.engine_managed)
        return self._checkpointer.load(input_dir, options)

    def register_for_checkpointing(self, *objects: object) -> None:
        """Save and load these objects (each needs ``state_dict``/``load_state_dict``) with the training state."""
        self._checkpointer.register(*objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs before models are saved; returns a removable handle."""
        return self._checkpointer.add_hook(self._checkpointer.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs before models are loaded; returns a removable handle."""
        return self._checkpointer.add_hook(self._checkpointer.load_hooks, hook)

    def resume_from_auto_checkpoint(self) -> str | None:
        """impel: with ``auto_resume``, load the newest complete checkpoint now rather than when the first prepared
        dataloader starts (a loop that plans its steps from the restored state calls this first). Returns its path;
        None without ``auto_resume``, without a checkpoint, or when the resume already happened."""
        return self._resilience.resume_now() if self._resilience is not None else None

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        return skip_first_batches(dataloader, num_batches)

    def free_memory(self, *objects: object) -> list[None]:
        """Drop impel's references to prepared objects and release cached device memory (and the CPU buffers of
        asynchronous saves; a pending one still finishes)."""
        self.prepared.clear()
        self._checkpointer.drop_staging_buffers()
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    clear = free_memory

    # --- trackers (Accelerate's API) ----------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: Mapping[str, object] | None = None,
                      init_kwargs: Mapping[str, Mapping[str, object]] | None = None) -> None:
        """Start the ``log_with`` trackers (main process only, unless ``main_process_only=False``), built with
        ``init_kwargs[name]``, under ``logging_dir`` (else ``project_dir``, else "."); store ``config``."""
        where = self.project_configuration.logging_dir or self.project_configuration.project_dir or "."
        self._tracking.start(project_name, str(where), config, init_kwargs, self.is_main_process)

    def log(self, values: Options, step: int | None = None, log_kwargs: Mapping[str, Options] | None = None) -> None:
        """Log ``values`` at ``step`` to every tracker, with ``log_kwargs[name]`` (a no-op without trackers)."""
        self._tracking.log(values, step, log_kwargs, jsonl_step=self.step)

    @property
    def trackers(self) -> list[GeneralTracker]:
        return list(self._tracking.trackers)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (unwrap: its SummaryWriter / wandb run / mlflow run)."""
        return self._tracking.get(name, unwrap)

    def end_training(self) -> None:
        """Close the trackers, stop impel's signal handling, tear down the strategy, wait for every rank and destroy
        the process group impel created (as Accelerate does): collectives after this raise. A pending asynchronous
        save is waited for first (its failure raises here)."""
        self._checkpointer.close()
        self._tracking.finish()
        if self._resilience is not None:
            self._resilience.uninstall()
        self.strategy.teardown()
        self.wait_for_everyone()
        self.state.destroy_process_group()
