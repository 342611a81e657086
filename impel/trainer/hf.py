"""transformers' ``Trainer``, running on impel's Accelerator.

``impel.trainer.hf.Trainer`` is ``transformers.Trainer`` itself (its loop, arguments, callbacks, logging, evaluation,
checkpoint format and token-level loss bookkeeping: ``num_items_in_batch`` counted over the accumulation window and,
with ``average_tokens_across_devices``, across ranks) with one method replaced: the Accelerator it builds is impel's.
Every call transformers makes through Accelerate (``prepare``, ``backward``, ``no_sync``, ``clip_grad_norm_``,
``gather_for_metrics``, ``pad_across_processes``, ``unwrap_model``, ``get_state_dict``, ...) reaches impel, so the
launch config, impel's DDP and process group, and its prepared dataloaders run transformers' loop.
``TrainingArguments`` is transformers' class; ``fsdp`` / ``fsdp_config`` build impel's FSDP2 plugin (transformers'
FSDP checkpoint calls are served by :mod:`impel.trainer.hf_fsdp`), ``deepspeed`` impel's DeepSpeed plugin
(:mod:`impel.trainer.hf_deepspeed`), ``parallelism_config`` impel's ParallelismConfig (its data-parallel sizes;
:data:`impel.trainer.hf_fields.NOTES`); the others are transformers' own behaviour.

Example (a transformers script with the import renamed)::

    from impel import Trainer, TrainingArguments   # = impel.trainer.hf's; was: from transformers import ...

    args = TrainingArguments(output_dir="out", do_train=True, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, average_tokens_across_devices=True)
    Trainer(model=model, args=args, train_dataset=train).train()
"""
from __future__ import annotations

import functools
import inspect
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import transformers
    import transformers.trainer
    from transformers import (
        EarlyStoppingCallback,
        EvalPrediction,
        ProgressCallback,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
        default_data_collator,
        get_scheduler,
    )
    from transformers.trainer_utils import PredictionOutput, TrainOutput
except ImportError as exc:
    raise ImportError("impel's Trainer (impel.Trainer, impel.TrainingArguments, impel.trainer.hf) is transformers' "
                      "Trainer on impel's Accelerator and needs transformers 5.24 or newer: "
                      "pip install 'impel[transformers]'") from exc

from impel.accelerator.facade import Accelerator
from impel.config.environment_settings import launched_settings
from impel.config.parallelism import ParallelismConfig
from impel.config.plugins import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
)
from impel.config.run_config import ConfigError
from impel.runtime.loaders.data import skip_first_batches as impel_skip_first_batches
from impel.runtime.loaders.prepared_loader import PreparedLoader
from impel.runtime.step.compile import TorchDynamoPlugin
from impel.trainer import hf_callbacks, hf_deepspeed, hf_fsdp, hf_ref_model, hf_remote, hf_resume

if TYPE_CHECKING:
    import torch

# transformers' own classes, re-exported so that `from impel import TrainerCallback, ...` names them
__all__ = ["EarlyStoppingCallback", "EvalPrediction", "PredictionOutput", "ProgressCallback", "TrainOutput", "Trainer",
           "TrainerCallback", "TrainerControl", "TrainerState", "TrainingArguments", "accelerator_arguments",
           "default_data_collator", "get_scheduler"]

_ACCELERATE_SKIP_FIRST_BATCHES = transformers.trainer.skip_first_batches


def skip_first_batches(dataloader: object, num_batches: int = 0) -> Any:
    """transformers' module-level ``skip_first_batches`` (a mid-epoch resume), resolved to impel's for impel's
    prepared loaders and left to Accelerate's for the others (transformers' Trainer on Accelerate is unchanged)."""
    if isinstance(dataloader, PreparedLoader):
        return impel_skip_first_batches(dataloader, num_batches)
    return _ACCELERATE_SKIP_FIRST_BATCHES(dataloader, num_batches)


transformers.trainer.skip_first_batches = skip_first_batches
hf_fsdp.install()
hf_deepspeed.install()

_LOADER_KEYS = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")


def _accumulation_plugin(args: TrainingArguments) -> GradientAccumulationPlugin:
    """transformers accumulates itself: impel's Accelerator gets ``num_steps=1`` (no second division)."""
    kwargs = dict(args.accelerator_config.gradient_accumulation_kwargs or {})
    if "num_steps" in kwargs:
        if args.gradient_accumulation_steps > 1:
            raise ConfigError(f"accelerator_config gradient_accumulation_kwargs num_steps={kwargs['num_steps']!r} "
                              f"and gradient_accumulation_steps={args.gradient_accumulation_steps}: set one of them")
        args.gradient_accumulation_steps = kwargs["num_steps"]
    kwargs["num_steps"] = 1
    return GradientAccumulationPlugin(**kwargs)


def _loader_config(args: TrainingArguments) -> DataLoaderConfiguration:
    """``data_seed`` seeds the seedable sampler only (Accelerate ignores it otherwise; transformers' own sampler
    reads it either way), so it is passed only with ``use_seedable_sampler``."""
    config = args.accelerator_config.to_dict()
    seed = args.data_seed if config["use_seedable_sampler"] else None
    return DataLoaderConfiguration(**{key: config[key] for key in _LOADER_KEYS}, data_seed=seed,
                                   non_blocking=config["non_blocking"])


def _ddp_kwargs(args: TrainingArguments, model: torch.nn.Module) -> DistributedDataParallelKwargs:
    """transformers' rule: ``ddp_find_unused_parameters`` if set, else False for a checkpointing PreTrainedModel."""
    find_unused = args.ddp_find_unused_parameters
    if find_unused is None:
        if isinstance(model, transformers.PreTrainedModel):
            find_unused = not (model.is_activation_checkpointing or args.activation_checkpointing)
        else:
            find_unused = True
    kwargs: dict[str, Any] = {"find_unused_parameters": find_unused}
    for name in ("bucket_cap_mb", "broadcast_buffers", "static_graph"):
        value = getattr(args, f"ddp_{name}")
        if value is not None:
            kwargs[name] = value
    return DistributedDataParallelKwargs(**kwargs)


_MESH_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")


def _parallelism(args: TrainingArguments, model: torch.nn.Module) -> ParallelismConfig | None:
    """``parallelism_config`` (Accelerate's or impel's ParallelismConfig) as impel's: the data-parallel sizes
    (``dp_replicate_size``, ``dp_shard_size``: DDP, FSDP2, HSDP on impel's device mesh). Tensor and context
    parallelism raise: transformers' Trainer shards such a model at load time and rescales its losses by the mesh,
    which this route has not been checked against; train them in a custom loop on impel's Accelerator."""
    given = args.parallelism_config
    if getattr(model, "tp_size", None) not in (None, 1):
        raise ConfigError(f"a model sharded at load time (tp_size={model.tp_size}, from_pretrained(tp_plan=...)) on "
                          "impel.trainer.hf.Trainer: not served on this route; load it unsharded and pass "
                          "ParallelismConfig(tp_size=...) to impel's Accelerator in a custom loop")
    if given is None:
        return None
    for name in ("tp_size", "cp_size", "sp_size"):
        if getattr(given, name, 1) not in (None, 1):
            raise ConfigError(f"TrainingArguments(parallelism_config=ParallelismConfig({name}="
                              f"{getattr(given, name)})) on impel.trainer.hf.Trainer: only the data-parallel sizes "
                              "(dp_replicate_size, dp_shard_size) are served on this route; pass "
                              f"ParallelismConfig({name}=...) to impel's Accelerator in a custom loop")
    if isinstance(given, ParallelismConfig):
        return given
    sizes = {name: getattr(given, name) for name in _MESH_SIZES}
    return ParallelismConfig(**sizes)


def accelerator_arguments(args: TrainingArguments, model: torch.nn.Module) -> dict[str, Any]:
    """impel ``Accelerator(...)`` keywords for transformers' ``TrainingArguments`` (what transformers hands
    Accelerate's, built from impel's classes)."""
    dynamo = None
    if args.torch_compile:
        dynamo = TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
    _check_fsdp_config(args)
    fsdp = None if args.fsdp_plugin_args is None else FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    return {"mixed_precision": args.mixed_precision, "cpu": True if args.use_cpu else None,
            "gradient_accumulation_plugin": _accumulation_plugin(args), "dataloader_config": _loader_config(args),
            "kwargs_handlers": [_ddp_kwargs(args, model)], "dynamo_plugin": dynamo, "fsdp_plugin": fsdp,
            "deepspeed_plugin": hf_deepspeed.plugin_for(args), "parallelism_config": _parallelism(args, model)}


# the fsdp_config keys transformers turns into plugin arguments (or reads itself) for FSDP2 (``version: 2``, the
# default): TrainingArguments._process_fsdp_args. Any other key (FSDP1's forward_prefetch, backward_prefetch,
# use_orig_params, sync_module_states, limit_all_gathers, a typo) would be dropped without a word.
_FSDP2_CONFIG_KEYS = frozenset({
    "version", "min_num_params", "transformer_layer_cls_to_wrap", "auto_wrap_policy", "cpu_offload",
    "cpu_ram_efficient_loading", "state_dict_type", "activation_checkpointing", "reshard_after_forward",
    "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings"})


def _check_fsdp_config(args: TrainingArguments) -> None:
    """Every ``fsdp_config`` key takes effect or raises: transformers passes only some of them to the plugin."""
    ignored = sorted(set(args.fsdp_config or {}) - _FSDP2_CONFIG_KEYS)
    if args.fsdp_plugin_args is not None and ignored:
        raise ConfigError(f"fsdp_config keys {ignored} have no effect under FSDP2 (transformers passes only "
                          f"{sorted(_FSDP2_CONFIG_KEYS - {'xla', 'xla_fsdp_v2', 'xla_fsdp_grad_ckpt'})} to the "
                          "plugin, and impel runs FSDP2 only); remove them")


def _check_fsdp(args: TrainingArguments, plugin: Any) -> None:
    """transformers' checks after building the Accelerator, for impel's FSDP plugin."""
    if getattr(plugin, "activation_checkpointing", False) and args.activation_checkpointing:
        raise ConfigError("fsdp_config activation_checkpointing=True and activation_checkpointing=True (or "
                          "gradient_checkpointing=True): set only one; under FSDP use fsdp_config's")
    if args.save_only_model and args.load_best_model_at_end:
        raise ConfigError("save_only_model=True with load_best_model_at_end=True under fsdp: the best checkpoint "
                          "needs the full state; set one of them to False")
    if args.save_only_model and "SHARDED_STATE_DICT" in str(plugin.state_dict_type):
        raise ConfigError("save_only_model=True with fsdp_config state_dict_type='SHARDED_STATE_DICT': use "
                          "FULL_STATE_DICT or save_only_model=False")


def _check_world(args: TrainingArguments, accelerator: Accelerator) -> None:
    """transformers sizes batches, logs and saves by Accelerate's process state (``args.world_size``,
    ``args.process_index``); it must see the processes impel runs."""
    if args.world_size != accelerator.num_processes:
        raise ConfigError(f"transformers' TrainingArguments see {args.world_size} process(es) (Accelerate's process "
                          f"state) but impel runs {accelerator.num_processes}: on a machine without GPUs set "
                          "TrainingArguments(use_cpu=True) or ACCELERATE_USE_CPU=1 (Accelerate finds no backend "
                          "there otherwise)")


def _check_auto_resume() -> None:
    """The launch config's ``auto_resume`` resumes (and, on SIGTERM, writes) the Accelerator's ``save_state``
    checkpoints; the Trainer writes transformers' ``checkpoint-N``, so its switch is ``resume_from_checkpoint``."""
    if (launched_settings() or {}).get("auto_resume"):
        raise ConfigError("auto_resume=true in the launch config (impel launch --auto_resume) resumes the "
                          "Accelerator's save_state checkpoints, which the Trainer does not write: drop it and call "
                          "trainer.train(resume_from_checkpoint=\"auto\") (the newest complete checkpoint-N in "
                          "output_dir; from scratch when there is none)")


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` on impel's Accelerator: same constructor, members and behaviour, plus impel's
    additions (:mod:`impel.trainer.hf_callbacks`): ``metrics.jsonl`` and ``loss.png`` in ``output_dir``
    (``plot_loss``: None draws when matplotlib is installed, True requires it, False skips), checkpoints marked
    complete, and ``train(resume_from_checkpoint="auto")``."""

    def __init__(self, *args: object, plot_loss: bool | None = None, **kwargs: object) -> None:
        self.remote_output: hf_remote.RemoteOutput | None = None  # an output_dir URL (impel.trainer.hf_remote)
        super().__init__(*args, **kwargs)
        self.add_callback(hf_callbacks.MetricsLog(plot_loss))
        self.add_callback(hf_callbacks.CompleteCheckpoints(self.accelerator))
        if self.remote_output is not None:
            self.add_callback(hf_remote.UploadOutput(self.remote_output))

    @property
    def output_url(self) -> str | None:
        """The object-storage URL given as ``output_dir`` (``args.output_dir`` is then its local mirror), or None."""
        return None if self.remote_output is None else self.remote_output.url

    def train(self, resume_from_checkpoint: str | os.PathLike[str] | bool | None = None, *args: object,
              **kwargs: object) -> TrainOutput:
        """transformers' ``train``; ``resume_from_checkpoint="auto"`` / True take the newest *complete*
        checkpoint (``"auto"`` starts from scratch when there is none)."""
        if self.remote_output is not None:
            resume_from_checkpoint = self.remote_output.fetch(resume_from_checkpoint, self.accelerator)
        resume = hf_resume.resolve_resume(resume_from_checkpoint, self.args.output_dir, self.is_world_process_zero())
        return super().train(resume, *args, **kwargs)

    def _save_checkpoint(self, model: torch.nn.Module, trial: object) -> None:
        """transformers' save, begun by impel's ``impel_saving.json`` (an older complete marker dropped first), so
        a save cut short is provably impel's own (:mod:`impel.trainer.hf_resume`)."""
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        if self.is_world_process_zero() and self.args.should_save:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / hf_resume.MARKER).unlink(missing_ok=True)
            (folder / hf_resume.SAVING).write_text(json.dumps({"global_step": self.state.global_step}) + "\n",
                                                   encoding="utf-8")
        self.accelerator.wait_for_everyone()  # no rank writes into the folder before it is marked
        hf_ref_model.save(self, str(folder))  # TRL's sync_ref_model: the synced reference model too
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """transformers' load, and the reference model :mod:`impel.trainer.hf_ref_model` saved."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        hf_ref_model.load(self, resume_from_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """transformers' ``save_model``; with an ``output_dir`` URL, what it wrote into the mirror is uploaded."""
        super().save_model(output_dir, _internal_call)
        mirrored = output_dir is None or os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir)
        if self.remote_output is not None and mirrored and self.args.should_save:
            self.remote_output.upload_outputs()

    def create_accelerator_and_postprocess(self) -> None:
        _check_auto_resume()
        self.remote_output = hf_remote.mirror(self.args)  # before transformers makes output_dir a local folder
        self.accelerator = Accelerator(**accelerator_arguments(self.args, self.model))
        gather = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(gather).parameters:
            gather = functools.partial(gather, use_gather_object=self.args.eval_use_gather_object)
        self.gather_function = gather
        _check_world(self.args, self.accelerator)
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        self.is_fsdp_enabled = plugin is not None  # its checkpoints: impel.trainer.hf_fsdp
        if plugin is not None:
            _check_fsdp(self.args, plugin)
        self.is_deepspeed_enabled = hf_deepspeed.adopt(self.args, self.accelerator)  # see hf_deepspeed
        if self.is_deepspeed_enabled and self.args.save_only_model and self.args.load_best_model_at_end:
            raise ConfigError("save_only_model=True with load_best_model_at_end=True under deepspeed: the best "
                              "checkpoint needs the full state; set one of them to False")

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: torch.Tensor | float | None = None
                       ) -> torch.Tensor | float | None:
        """Under DeepSpeed the engine computes the norm inside ``optimizer.step()``: impel's ``clip_grad_norm_``
        returns a tensor it fills then, so it is logged as a tensor (transformers calls ``.item()`` at logging),
        not read before the step."""
        if not self.is_deepspeed_enabled:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        if grad_norm is None:
            grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        return grad_norm
