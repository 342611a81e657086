"""Names of Accelerate's module tree that impel deliberately does not provide, each with its reason.

Accelerate's module paths under impel's name (``impel.utils.modeling``, ``impel.hooks``, ...) resolve these names
so that ``from impel.hooks import add_hook_to_module`` imports, as it does under Accelerate; *using* one (calling
it, building it) raises :class:`NotProvidedError` naming it, why impel does not have it and what to use instead.
Introspection works (``inspect.signature``, ``help()``, mock autospec, completion); reading an attribute of one
raises :class:`NotProvidedAttributeError`, an ``AttributeError`` with the same reason, so ``hasattr`` answers
False. A name Accelerate does not have at all stays an ``AttributeError``. The big-model pieces that hold no
distributed state (hooks, dispatch, device maps, offloading: :data:`ACCELERATES_OWN`, which PEFT imports) are
Accelerate's own objects when Accelerate is installed, and such placeholders only without it.

Example::

    from impel.utils import FP8RecipeKwargs      # imports
    FP8RecipeKwargs(backend="te")                # NotProvidedError: impel does not provide FP8RecipeKwargs: ...
"""
from __future__ import annotations

import importlib
from typing import Any, NoReturn

_BIG_MODEL = "big-model inference (device maps, offloading, dispatch hooks) is not in impel's scope: impel trains; " \
             "load weights with impel.load_checkpoint_in_model and place the model with accelerator.prepare"
_FROM_ACCELERATE = "; with Accelerate installed (pip install 'accelerate>=1.15,<1.16') this name is Accelerate's own " \
                   "implementation (it holds no distributed state)"
_FP8 = "impel has no fp8 mode; train in bf16 (mixed_precision='bf16')"
_MEGATRON = "impel does not drive Megatron-LM; use FSDP, DeepSpeed or ParallelismConfig(tp_size=...)"
_QUANT = "quantised loading is not in impel's scope; quantise with transformers' " \
         "from_pretrained(quantization_config=...)"
_FSDP_IO = "impel saves and loads FSDP models itself; use accelerator.save_state / load_state (or save_model)"
_FSDP_INTERNAL = "an internal step of Accelerate's FSDP2 preparation; impel's FSDP runs through accelerator.prepare"
_DS_INTERNAL = "impel resolves and drives DeepSpeed itself; pass the JSON as DeepSpeedPlugin(hf_ds_config=...) and " \
               "use accelerator.prepare"
_LAUNCH_INTERNAL = "an internal step of `accelerate launch`; use `impel launch` (same flags)"
_SAGEMAKER = "SageMaker launching is not in impel's scope; use `impel launch` inside the job"
_PIPPY = "pipeline-parallel inference (PiPPy) is not in impel's scope"
_OTHER_DEVICES = "impel runs on CPUs and CUDA GPUs only"
_CHECKPOINT_INTERNAL = "an internal step of Accelerate's save_state / load_state; use accelerator.save_state / " \
                       "load_state (they read Accelerate's folders too) and register_for_checkpointing for your " \
                       "own objects"

_TRACKER = "not one of impel's built-in trackers (tensorboard, wandb, mlflow, trackio, jsonl); wrap its client in " \
           "a GeneralTracker subclass and pass an instance to log_with= (or register_tracker_class it)"

# accelerate.tracking's names, not accelerate.utils' (impel.utils leaves them out)
TRACKERS = ("AimTracker", "CometMLTracker", "ClearMLTracker", "DVCLiveTracker", "SwanLabTracker")

REASONS: dict[str, str] = {
    **{name: _TRACKER for name in TRACKERS},
    **{name: _BIG_MODEL for name in (
        "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model", "infer_auto_device_map",
        "load_checkpoint_and_dispatch", "get_balanced_memory", "get_max_layer_size", "clean_device_map",
        "check_device_map", "load_offloaded_weight", "load_offloaded_weights", "offload_weight", "save_offload_index",
        "align_module_device", "has_offloaded_params", "set_module_tensor_to_device", "OffloadedWeightsLoader",
        "PrefixedDataset", "offload_state_dict", "extract_submodules_state_dict", "get_max_memory",
        "get_state_dict_from_offload",
        "ModelHook", "SequentialHook", "AlignDevicesHook", "CpuOffload", "UserCpuOffloadHook", "LayerwiseCastingHook",
        "add_hook_to_module", "remove_hook_from_module", "attach_align_device_hook", "remove_hook_from_submodules",
        "attach_align_device_hook_on_blocks", "attach_execution_device_hook", "attach_layerwise_casting_hooks",
        "named_module_tensors", "retie_parameters", "check_tied_parameters_on_same_device",
        "check_tied_parameters_in_config", "calculate_maximum_sizes", "load_state_dict", "CustomDtype")},
    "get_module_class_from_name": "a helper of Accelerate's FSDP1 auto-wrap policy; impel's FSDP wraps by class name "
                                  "itself: FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=[...])",
    **{name: _FP8 for name in (
        "FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "check_cuda_fp8_capability",
        "torchao_required", "apply_fp8_autowrap", "convert_model")},
    **{name: _MEGATRON for name in (
        "MegatronLMPlugin", "MegatronLMDummyScheduler", "MegatronLMDummyDataLoader",
        "add_model_config_to_megatron_parser")},
    **{name: _QUANT for name in ("BnbQuantizationConfig", "load_and_quantize_model")},
    **{name: _FSDP_IO for name in (
        "load_fsdp_model", "save_fsdp_model", "load_fsdp_optimizer", "save_fsdp_optimizer")},
    **{name: _FSDP_INTERNAL for name in (
        "fsdp2_prepare_model", "fsdp2_load_full_state_dict", "fsdp2_switch_optimizer_parameters", "fsdp2_apply_ac",
        "fsdp2_canonicalize_names", "get_fsdp2_grad_scaler", "ensure_weights_retied",
        "enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading", "compile_regions_fsdp2",
        "compile_regions_deepspeed")},
    **{name: _DS_INTERNAL for name in (
        "HfDeepSpeedConfig", "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper",
        "map_pytorch_optim_to_deepspeed", "get_active_deepspeed_plugin", "DeepSpeedSequenceParallelConfig",
        "deepspeed_required")},
    **{name: _LAUNCH_INTERNAL for name in (
        "PrepareForLaunch", "prepare_deepspeed_cmd_env", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env",
        "prepare_tpu", "TORCH_LAUNCH_PARAMS")},
    **{name: _SAGEMAKER for name in (
        "SageMakerDistributedType", "prepare_sagemager_args_inputs")},
    **{name: _PIPPY for name in (
        "prepare_pippy", "generate_device_map", "find_pippy_batch_size", "build_pipeline", "pippy_forward")},
    **{name: _CHECKPOINT_INTERNAL for name in (
        "save_accelerator_state", "load_accelerator_state", "save_custom_state", "load_custom_state")},
    "patch_optimizer_step": "an internal step of Accelerate's AcceleratedOptimizer (it marks that optimizer.step ran); "
                            "read optimizer.step_was_skipped / accelerator.optimizer_step_was_skipped",
    "GatheredParameters": "DeepSpeed ZeRO-3's parameter gathering; use deepspeed.zero.GatheredParameters",
    "write_basic_config": "use `impel config default` (it writes the same file for this machine's hardware)",
    "get_gpu_info": _OTHER_DEVICES + "; read torch.cuda.device_count() / get_device_name()",
    "set_numa_affinity": "NUMA pinning is not in impel's scope; use numactl around `impel launch`",
    "check_cuda_p2p_ib_support": _OTHER_DEVICES + "; NCCL picks the transport itself",
    "compile_regions": "use TorchDynamoPlugin(use_regional_compilation=True) (impel compiles the repeated blocks at "
                       "prepare)",
    "clean_state_dict_for_safetensors": "use accelerator.get_state_dict(model) or accelerator.save_model (they write "
                                        "safetensors-ready weights)",
    "load": "use torch.load (impel's checkpoints load with accelerator.load_state)",
    "get_model_tp_size": "use accelerator.parallelism_config.tp_size",
    "get_cpu_distributed_information": "use PartialState() (process_index, local_process_index, num_processes)",
    "get_current_device_type": "use PartialState().device.type",
    "get_grad_scaler": "impel builds the fp16 GradScaler itself; pass GradScalerKwargs to the Accelerator",
    "get_mixed_precision_context_manager": "use accelerator.autocast()",
}


# big-model pieces that hold no distributed state (hooks, dispatch, device maps, offloading; PEFT imports them):
# Accelerate's own objects when Accelerate is installed, rather than a second implementation
ACCELERATES_OWN = frozenset(name for name, reason in REASONS.items() if reason == _BIG_MODEL) | {
    "get_module_class_from_name"}
for _name in ACCELERATES_OWN:
    REASONS[_name] += _FROM_ACCELERATE
_ACCELERATE_MODULES = ("accelerate.hooks", "accelerate.big_modeling", "accelerate.utils.modeling",
                       "accelerate.utils.dataclasses")


class NotProvidedError(NotImplementedError):
    """A name of Accelerate's API that impel deliberately does not provide was used."""


class NotProvidedAttributeError(NotProvidedError, AttributeError):
    """An attribute of a name impel does not provide was read: a :class:`NotProvidedError` that is also an
    ``AttributeError``, so ``hasattr``, ``getattr(x, name, default)``, ``inspect``, ``help()``, mock autospec and
    IDE completion treat it as absent instead of crashing."""


def _refuse(name: str) -> NoReturn:
    raise NotProvidedError(f"impel does not provide {name}: {REASONS[name]}")


class _NotProvided(type):
    """The type of a placeholder: building or calling it raises :class:`NotProvidedError`; reading an attribute it
    does not have raises :class:`NotProvidedAttributeError` (an AttributeError); introspection works."""

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        _refuse(cls.__name__)

    def __getattr__(cls, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotProvidedAttributeError(f"impel does not provide {cls.__name__} (so not {cls.__name__}.{attr}): "
                                        f"{REASONS[cls.__name__]}")


def placeholder(name: str) -> type:
    """The stand-in for ``name`` (one of :data:`REASONS`): importable, raising :class:`NotProvidedError` on use."""
    if name not in REASONS:
        raise KeyError(f"{name!r} is not one of impel.config.unsupported.REASONS")
    return _NotProvided(name, (), {"__doc__": f"Not provided by impel: {REASONS[name]}",
                                    "__module__": __name__})


_made: dict[str, object] = {}


def __getattr__(name: str) -> Any:
    if name not in REASONS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _made:
        own = _accelerates(name) if name in ACCELERATES_OWN else None
        _made[name] = placeholder(name) if own is None else own
    return _made[name]


def _accelerates(name: str) -> object:
    """Accelerate's own ``name`` (one of :data:`ACCELERATES_OWN`), or None when Accelerate is not installed."""
    for module in _ACCELERATE_MODULES:
        try:
            value = getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
        if value is not None:
            return value
    return None
