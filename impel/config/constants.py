"""Accelerate's constants (``accelerate.utils.constants``): the file names of its checkpoints and weights, the
accepted values of its FSDP settings, and the version floors it names. impel reads Accelerate's checkpoints under
these names (:mod:`impel.accelerator.load_accelerate`); scripts import them to find those files."""
from __future__ import annotations

import enum
import operator

# file names of Accelerate's save_state / save_model
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
FSDP_MODEL_NAME = "pytorch_model_fsdp"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

# the values Accelerate's config and flags accept for its FSDP settings
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
DEEPSPEED_MULTINODE_LAUNCHERS = ["pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm"]
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]

# version floors Accelerate names
FSDP_PYTORCH_VERSION = "2.1.0.a0+32f93b1"
FSDP2_PYTORCH_VERSION = "2.6.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"

STR_OPERATION_TO_FUNC = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
                         "<=": operator.le, "<": operator.lt}

# distributed types whose collectives run through torch.distributed (DistributedType values)
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = [*CUDA_DISTRIBUTED_TYPES, "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                                     "MULTI_XPU", "MULTI_CPU", "MULTI_HPU", "MULTI_NEURON"]


class ComputeEnvironment(str, enum.Enum):
    """Where a config file says the job runs (its ``compute_environment`` key); impel runs LOCAL_MACHINE jobs."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"
