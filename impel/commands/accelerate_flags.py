"""``accelerate launch``'s flags that have no run-config key: each works as Accelerate's or refuses with its reason.

- ``--env KEY=VALUE`` (repeatable): every rank gets the variable (Accelerate sets it on a TPU pod's machines).
  Variables impel launch itself sets from the config (``ACCELERATE_*``, ``IMPEL_*``, ``FSDP_*``,
  ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, torchrun's ``RANK`` / ``WORLD_SIZE`` / ...) are refused: pass
  their flag or config key instead.
- ``--main_training_function main``: the function Accelerate's TPU launcher calls by name; impel runs the script as
  ``python script.py`` does, so ``main`` (Accelerate's value, which the script's ``__main__`` block calls) is taken
  and any other name is refused.
- Refused when on, each with its reason (the same as its ``ACCELERATE_*`` variable's): ``--enable_cpu_affinity``,
  ``--downcast_bf16``, ``--deepspeed_moe_layer_cls_names``, ``--fsdp_activation_checkpointing_offload`` and the
  ``--parallelism_config_sp_*`` settings of DeepSpeed sequence parallelism (``--parallelism_config_sp_size`` is a
  config flag that must be 1).
- Refused on any use, for what impel does not run: the TPU flags (``--tpu``, ``--tpu_cluster``, ``--vm``, ...),
  Megatron-LM's (``--use_megatron_lm``, ``--megatron_lm_*``), FP8's (``--fp8_*``) and SageMaker's (``--aws_*``).
  (``--deepspeed_hostfile`` and its filters are run-config keys: :mod:`impel.commands.deepspeed_runner`.)
"""
from __future__ import annotations

import argparse
import re

from impel.config.environment_settings import UNSUPPORTED
from impel.config.run_config import FALSE_WORDS, TRUE_WORDS, ConfigError

_SP = "is a setting of DeepSpeed sequence parallelism (Ulysses), which impel does not run " \
      "(--parallelism_config_sp_size must be 1); remove it"
# store_true flags, as Accelerate's: on is refused
_SWITCHES = {
    "enable_cpu_affinity": UNSUPPORTED["ACCELERATE_CPU_AFFINITY"],
    "downcast_bf16": UNSUPPORTED["ACCELERATE_DOWNCAST_BF16"] + "; remove it (bf16 on GPUs: --mixed_precision bf16)",
}
# valued flags: (the values that mean "off", as Accelerate's defaults, lower case; why any other value is refused)
_VALUED = {
    "main_training_function": (("main",), "names the function Accelerate's TPU launcher calls; impel runs the "
                               "script as python does (call your function under if __name__ == '__main__': and "
                               "leave the flag out)"),
    "deepspeed_moe_layer_cls_names": ((), UNSUPPORTED["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"] +
                                      " before accelerator.prepare"),
    "fsdp_activation_checkpointing_offload": (FALSE_WORDS, "offloads checkpointed activations, which impel's FSDP2 "
                                              "does not do; use --fsdp_activation_checkpointing true alone"),
    "parallelism_config_sp_seq_length": ((), _SP),
    "parallelism_config_sp_seq_length_is_variable": (TRUE_WORDS, _SP),
    "parallelism_config_sp_attn_implementation": (("sdpa",), _SP),
}
_TPU = "is for TPUs (torch_xla) and TPU pods, which impel does not drive; remove it"
_MEGATRON = ("is a Megatron-LM setting, and impel does not run Megatron-LM (tensor parallelism: "
             "--parallelism_config_tp_size with FSDP2); remove it")
_FP8 = "is an FP8 training setting, and impel does not train in FP8 (--mixed_precision bf16 or fp16); remove it"
_SAGEMAKER = ("is for Amazon SageMaker launches, which impel does not make; run impel launch on the machines "
              "themselves, with the credentials in the environment")
# flags of Accelerate's launchers impel does not have: refused on any use, with the reason (switch: store_true)
_OUT_OF_SCOPE: dict[str, tuple[str, str]] = {
    "tpu": ("switch", _TPU), "tpu_cluster": ("switch", _TPU), "no_tpu_cluster": ("switch", _TPU),
    "tpu_use_sudo": ("switch", _TPU), "vm": ("append", _TPU),
    "use_megatron_lm": ("switch", _MEGATRON), "fp8_use_autocast_during_eval": ("switch", _FP8),
    "aws_access_key_id": ("valued", _SAGEMAKER), "aws_secret_access_key": ("valued", _SAGEMAKER),
    **{f"megatron_lm_{name}": ("valued", _MEGATRON) for name in (
        "tp_degree", "use_custom_fsdp", "no_load_optim", "eod_mask_loss", "overlap_cpu_optimizer_d2h_h2d",
        "no_save_optim", "optimizer_cpu_offload", "use_precision_aware_optimizer", "decoder_last_pipeline_num_layers",
        "pp_degree", "num_micro_batches", "sequence_parallelism", "recompute_activations", "use_distributed_optimizer",
        "gradient_clipping", "recompute_granularity", "recompute_method", "recompute_num_layers", "attention_backend",
        "expert_model_parallel_size", "context_parallel_size", "attention_dropout", "hidden_dropout",
        "attention_softmax_in_fp32", "expert_tensor_parallel_size", "calculate_per_token_loss",
        "use_rotary_position_embeddings")},
    **{f"fp8_{name}": ("valued", _FP8) for name in (
        "backend", "margin", "interval", "format", "amax_history_len", "amax_compute_algo",
        "override_linear_precision", "opt_level", "enable_fsdp_float8_all_gather", "pad_inner_dim")},
}
_DEST = "accelerate_only__"
_LAUNCHER_SET = re.compile(r"^(ACCELERATE_|IMPEL_|FSDP_|TORCHELASTIC_)|^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|"
                           r"GROUP_RANK|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS|CUDA_VISIBLE_DEVICES)$")


def add_accelerate_only_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("accelerate launch's other flags (each works as Accelerate's or refuses with "
                                  "its reason)")
    g.add_argument("--env", action="append", default=None, metavar="KEY=VALUE",
                   help="set an environment variable on every rank (repeatable)")
    for flag, why in _SWITCHES.items():
        g.add_argument(f"--{flag}", action="store_true", dest=_DEST + flag, help=f"refused: {why}")
    for flag, (off, why) in _VALUED.items():
        g.add_argument(f"--{flag}", default=None, dest=_DEST + flag, metavar="VALUE",
                       help=f"taken as {off[0]!r}; otherwise refused: it {why}" if off else f"refused: it {why}")
    out = parser.add_argument_group("accelerate launch's flags for what impel does not run (TPU, Megatron-LM, FP8, "
                                    "SageMaker): refused with the reason")
    for flag, (kind, _) in _OUT_OF_SCOPE.items():
        if kind == "switch":
            out.add_argument(f"--{flag}", action="store_true", dest=_DEST + flag, help=argparse.SUPPRESS)
        else:
            out.add_argument(f"--{flag}", action="append" if kind == "append" else "store", default=None,
                             dest=_DEST + flag, help=argparse.SUPPRESS)


def accelerate_only_settings(ns: argparse.Namespace) -> dict[str, str]:
    """Refuse what impel cannot honour; the variables ``--env`` gives every rank."""
    for flag, why in _SWITCHES.items():
        if getattr(ns, _DEST + flag, False):
            raise ConfigError(f"--{flag} {why}")
    for flag, (off, why) in _VALUED.items():
        value = getattr(ns, _DEST + flag, None)
        if value is not None and value.lower() not in off:
            raise ConfigError(f"--{flag} {value!r} {why}")
    for flag, (_, why) in _OUT_OF_SCOPE.items():
        if getattr(ns, _DEST + flag, None) not in (None, False):
            raise ConfigError(f"--{flag} {why}")
    variables: dict[str, str] = {}
    for item in getattr(ns, "env", None) or []:
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"--env {item!r} must be KEY=VALUE with a variable name as KEY (--env HF_HOME=/data)")
        if _LAUNCHER_SET.search(key):
            raise ConfigError(f"--env {item!r}: impel launch sets {key} itself (from the config and torchrun); "
                              "pass the setting as its flag or config key instead (--num_cpu_threads_per_process, "
                              "--gpu_ids, --mixed_precision, ...)")
        variables[key] = value
    return variables
