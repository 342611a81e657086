"""The run config: typed dataclasses, validation with clear messages, and the one-way merge.

Precedence: defaults < YAML file < launch flags < arguments in code: ``impel launch`` exports the explicitly set keys
as JSON (:mod:`impel.config.environment`) and the Accelerator merges its own arguments on top
(:func:`merge_code_arguments`). Key
names are Accelerate's, so its files load unchanged. Each field carries its schema in ``metadata`` (kind, choices,
minimum, help, prompt, flag name): the CLI flags, the questionnaire and validation all derive from these dataclasses.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from impel.config.dynamo import DynamoConfig
from impel.config.elastic import check_elastic
from impel.config.launch_values import check_launch_values
from impel.config.mesh_sizes import ParallelismSection, check_strategy, check_world_size, total_size
from impel.config.schema import (  # noqa: F401 - re-exported: impel.config.run_config is where the rest of impel imports them from
    FALSE_WORDS,
    TRUE_WORDS,
    ConfigError,
    Freezable,
    Section,
    bool_word,
    coerce,
    did_you_mean,
    option,
    plugin_keyword,
    plugin_keywords,
)
from impel.config.schema import validate_fields as _validate_fields

logger = logging.getLogger("impel")


class DistributedType(str, enum.Enum):
    """How the run is distributed; members compare equal to their names (``DistributedType.FSDP == "FSDP"``).

    Every member of Accelerate's enum exists, so ``accelerator.distributed_type == DistributedType.XLA`` works;
    selecting one impel does not drive (XLA, NPU, ...) raises (:func:`check_distributed_type`).
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    AUTO = "AUTO"  # resolved by `impel launch` from a memory estimate; never reaches a rank

    def __str__(self) -> str:
        return self.value


DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", "AUTO")  # what impel runs
_NOT_DRIVEN = {"MULTI_NPU": "Ascend NPUs", "MULTI_MLU": "Cambricon MLUs", "MULTI_SDAA": "Tecorigin SDAAs",
               "MULTI_MUSA": "Moore Threads MUSA GPUs", "MULTI_XPU": "Intel XPUs", "XLA": "TPUs through torch_xla",
               "MEGATRON_LM": "Megatron-LM", "MULTI_HPU": "Habana HPUs", "MULTI_NEURON": "AWS Neuron cores"}


def check_distributed_type(value: object) -> None:
    """Raise for an Accelerate distributed type naming hardware or an engine impel does not drive."""
    name = str(value).upper() if isinstance(value, str) else value
    if name in _NOT_DRIVEN:
        raise ConfigError(f"distributed_type={str(value)!r} selects {_NOT_DRIVEN[name]}, which impel does not drive; "
                          f"impel runs {', '.join(DISTRIBUTED_TYPES[:-1])} on CPUs and CUDA GPUs: pick one of those "
                          "(or keep this script on Accelerate)")


class PrecisionType(str, enum.Enum):
    """Accelerate's mixed-precision modes; impel runs ``no``, ``fp16`` and ``bf16`` (``fp8`` raises)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


MIXED_PRECISIONS = ("no", "fp16", "bf16")
# in FSDP1's ShardingStrategy order: Accelerate accepts their numbers (1 = FULL_SHARD, ...)
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# sharding strategy -> FSDP2's reshard_after_forward; NO_SHARD (one shard per rank) implies nothing
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)
MULTINODE_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")  # Accelerate's
DEFAULT_ZERO_STAGE = 2  # Accelerate's DeepSpeedPlugin default, used when no DeepSpeed JSON says otherwise


def reshards_after_forward(strategy: str) -> bool:
    """FSDP2's ``reshard_after_forward`` for a sharding strategy (False for NO_SHARD, where it changes nothing)."""
    return RESHARD_AFTER_FORWARD.get(strategy, False)


def check_zero_stage(value: object, what: str) -> None:
    """Raise unless ``value`` is a ZeRO stage; ``what`` names where it came from (``zero_stage=4``)."""
    if value not in ZERO_STAGES:
        stages = ", ".join(str(s) for s in ZERO_STAGES[:-1]) + f" or {ZERO_STAGES[-1]}"
        raise ConfigError(f"{what} is not a DeepSpeed ZeRO stage; use {stages}")


# --- sections ------------------------------------------------------------------------------------------------
# FSDP1's ShardingStrategy numbers, as Accelerate accepts them (YAML 1 or "1", flag --fsdp_sharding_strategy 1)
_FSDP1_STRATEGY_NUMBERS: dict[object, str] = {k: v for n, v in enumerate(SHARDING_STRATEGIES, 1) for k in (n, str(n))}
_WRAPPING_NOTE = "wrapping is transparent in DeepSpeed (it partitions every parameter)"
_PREFETCH_NOTE = "prefetching is automatic in DeepSpeed (tune stage3_prefetch_bucket_size in a DeepSpeed JSON)"


@dataclass
class FSDPConfig(Freezable):
    """The ``fsdp_config`` section. YAML keys and flags carry an ``fsdp_`` prefix (``fsdp_sharding_strategy``).

    The one place an FSDP option is written: ``FullyShardedDataParallelPlugin``'s keywords, the Trainer's
    ``fsdp_config`` keys, the launch flags, the questionnaire and ``impel config convert`` derive from these fields.
    """

    PREFIX = "fsdp_"

    version: int = option(2, "int", "FSDP version: impel runs FSDP2 (fully_shard) only; 1 raises",
                          choices=(1, 2), plugin="fsdp_version", deepspeed_note="no DeepSpeed counterpart")
    sharding_strategy: str | None = option(
        None, "str", "how parameters, gradients and optimizer states are sharded", choices=SHARDING_STRATEGIES,
        question="Sharding strategy", suggest="FULL_SHARD",
        aliases={**_FSDP1_STRATEGY_NUMBERS, "_HYBRID_SHARD_ZERO2": "HYBRID_SHARD_ZERO2"})
    # `accelerate config` writes an FSDP1 answer here as a strategy name (FULL_SHARD): read it as FSDP2's bool
    reshard_after_forward: bool | None = option(
        None, "bool", "free gathered parameters after forward (FSDP2's name for FULL_SHARD vs SHARD_GRAD_OP)",
        aliases=RESHARD_AFTER_FORWARD, deepspeed_note="folded into zero_stage")
    offload_params: bool = option(False, "bool", "keep parameters, gradients and optimizer states on the CPU "
                                  "(all or nothing)", question="Offload parameters to the CPU", also=("cpu_offload",))
    auto_wrap_policy: str | None = option(
        None, "str", "which submodules become their own FSDP unit (default: transformer layers when the model "
        "names them, else the root only)", choices=("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
        question="Auto wrap policy", suggest="TRANSFORMER_BASED_WRAP", deepspeed_note=_WRAPPING_NOTE)
    transformer_layer_cls_to_wrap: str | None = option(
        None, "str", "comma-separated layer class names to wrap (default: detected from the model)",
        question="Layer classes to wrap (comma-separated, empty = detect)", listed=True,
        plugin="transformer_cls_names_to_wrap", ask_if=("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
        deepspeed_note=_WRAPPING_NOTE)
    min_num_params: int = option(100_000_000, "int", "SIZE_BASED_WRAP: parameters per unit", minimum=1,
                                 question="Minimum parameters per unit", ask_if=("auto_wrap_policy", "SIZE_BASED_WRAP"),
                                 deepspeed_note=_WRAPPING_NOTE)
    backward_prefetch: str | None = option(
        "BACKWARD_PRE", "str", "when the next unit's parameters are gathered in backward",
        choices=("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"), question="Backward prefetch",
        deepspeed_note=_PREFETCH_NOTE)
    forward_prefetch: bool = option(False, "bool", "gather the next unit's parameters during forward",
                                    question="Forward prefetch", deepspeed_note=_PREFETCH_NOTE)
    state_dict_type: str = option("SHARDED_STATE_DICT", "str", "checkpoint format",
                                  choices=("FULL_STATE_DICT", "SHARDED_STATE_DICT"), question="State dict type")
    use_orig_params: bool = option(True, "bool", "FSDP2 always trains the original parameters; false is an error",
                                   deepspeed_note="DeepSpeed keeps the original parameters; nothing to set")
    sync_module_states: bool = option(
        True, "bool", "broadcast rank 0's weights at prepare",
        deepspeed_note="DeepSpeed broadcasts rank 0's weights at initialisation; nothing to set")
    cpu_ram_efficient_loading: bool = option(
        False, "bool", "only rank 0 reads real weights; the others build on the meta device (turns on "
        "sync_module_states)", question="CPU-RAM-efficient loading")
    activation_checkpointing: bool = option(
        False, "bool", "recompute each wrapped unit's activations in backward", question="Activation checkpointing",
        deepspeed_note="no counterpart in the launch config: enable gradient checkpointing on the model "
                       "(model.gradient_checkpointing_enable()) or in a DeepSpeed JSON")

    def validate(self) -> FSDPConfig:
        _validate_fields(self)
        if self.version == 1:
            raise ConfigError("fsdp_version=1 selects FSDP1 (FullyShardedDataParallel), which impel does not run: "
                              "impel runs FSDP2 (fully_shard) only. Set fsdp_version to 2 (fsdp_version: 2 in the "
                              "config, --fsdp_version 2, FullyShardedDataParallelPlugin(fsdp_version=2)) or remove it; "
                              "the other FSDP options carry over (docs/fsdp.md). A config file converts in one "
                              "command, as with accelerate to-fsdp2: impel to-fsdp2 --config_file FILE "
                              "--output_file NEW.yaml")
        if not self.use_orig_params:
            raise ConfigError("fsdp_use_orig_params=false has no FSDP2 equivalent (FSDP2 always trains the original "
                              "parameters); set it to true or remove it")
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise ConfigError("fsdp_cpu_ram_efficient_loading=true needs fsdp_sync_module_states=true (the other "
                              "ranks receive rank 0's weights); remove fsdp_sync_module_states or set it to true")
        want = RESHARD_AFTER_FORWARD.get(self.sharding_strategy or "")
        if self.reshard_after_forward is not None and want is not None and want != self.reshard_after_forward:
            raise ConfigError(f"fsdp_reshard_after_forward={self.reshard_after_forward} contradicts "
                              f"fsdp_sharding_strategy={self.sharding_strategy!r}; set only one of them")
        return self

    @property
    def resolved_sharding_strategy(self) -> str:
        if self.sharding_strategy is not None:
            return self.sharding_strategy
        return "SHARD_GRAD_OP" if self.reshard_after_forward is False else "FULL_SHARD"


@dataclass
class DeepSpeedConfig(Freezable):
    """The ``deepspeed_config`` section; None means "take it from the DeepSpeed JSON, else DeepSpeed's default"."""

    PREFIX = ""

    # in the order of DeepSpeedPlugin's keywords (Accelerate's), which are generated from these fields
    gradient_clipping: float | None = option(None, "float", "max gradient norm", minimum=0.0,
                                             question="Gradient clipping (empty = none)")
    zero_stage: int | None = option(None, "int", "ZeRO stage", choices=ZERO_STAGES, question="ZeRO stage",
                                    suggest=DEFAULT_ZERO_STAGE)
    offload_optimizer_device: str | None = option(None, "str", "where optimizer states live", choices=OFFLOAD_DEVICES,
                                                  question="Offload the optimizer to", suggest="none")
    offload_param_device: str | None = option(None, "str", "where parameters live (ZeRO-3)", choices=OFFLOAD_DEVICES,
                                              question="Offload parameters to", suggest="none")
    offload_optimizer_nvme_path: str | None = option(None, "str", "NVMe directory for optimizer offload",
                                                     question="NVMe path for the optimizer")
    offload_param_nvme_path: str | None = option(None, "str", "NVMe directory for parameter offload",
                                                 question="NVMe path for parameters")
    zero3_init_flag: bool | None = option(None, "bool", "partition ZeRO-3 models at construction",
                                          question="Partition models at construction (zero3_init_flag)", suggest=False)
    zero3_save_16bit_model: bool | None = option(None, "bool", "save_model gathers 16-bit weights under ZeRO-3",
                                                 question="Save 16-bit weights under ZeRO-3", suggest=False)
    # DeepSpeedPlugin's hf_ds_config, written by hand: it also takes a dict, which stays in the process
    deepspeed_config_file: str | None = option(None, "str", "DeepSpeed JSON for every other setting",
                                               question="DeepSpeed JSON file (empty = none)", plugin=False)
    # several machines: DeepSpeed's own runner (impel.commands.deepspeed_runner), as accelerate launch
    deepspeed_multinode_launcher: str | None = option(
        None, "str", "several machines: how DeepSpeed's runner starts the hostfile's machines (default: pdsh with a "
        "deepspeed_hostfile; standard: impel launch started on every machine, no runner)",
        choices=MULTINODE_LAUNCHERS, plugin=False)
    deepspeed_hostfile: str | None = option(None, "str", "several machines: DeepSpeed's runner starts the ranks on "
                                            "the hosts of this hostfile ('host slots=N' lines)", plugin=False)
    deepspeed_inclusion_filter: str | None = option(None, "str", "DeepSpeed's --include: the hostfile's hosts (and "
                                                    "slots) to use, e.g. 'worker-0@worker-1:0,1'", plugin=False)
    deepspeed_exclusion_filter: str | None = option(None, "str", "DeepSpeed's --exclude: the hostfile's hosts (or "
                                                    "slots) not to use, e.g. 'worker-1:0'", plugin=False)

    def validate(self) -> DeepSpeedConfig:
        if self.zero_stage is not None:
            check_zero_stage(self.zero_stage, f"zero_stage={self.zero_stage!r}")
        _validate_fields(self)
        for what in ("optimizer", "param"):
            path_needed = not getattr(self, f"offload_{what}_nvme_path") and not self.deepspeed_config_file
            if getattr(self, f"offload_{what}_device") == "nvme" and path_needed:  # (a JSON may hold the path)
                raise ConfigError(f"offload_{what}_device='nvme' needs offload_{what}_nvme_path; set it to a "
                                  "directory on the NVMe drive")
        if self.offload_param_device not in (None, "none") and self.zero_stage not in (None, 3):
            raise ConfigError(f"offload_param_device={self.offload_param_device!r} needs zero_stage=3 (got "
                              f"zero_stage={self.zero_stage}); use offload_optimizer_device or ZeRO-3")
        return self


SECTIONS: dict[str, type[Section]] = {"fsdp_config": FSDPConfig, "deepspeed_config": DeepSpeedConfig,
                                      "dynamo_config": DynamoConfig, "parallelism_config": ParallelismSection}


NOT_YET = {"fsdp_ignored_modules": "is not supported yet: impel does not exclude modules from FSDP2 sharding; "
                                   "remove it (the modules are then sharded like the rest)"}  # named, never ignored


def section_keys(cls: type[Section]) -> dict[str, str]:
    """YAML key -> field name for one section."""
    return {cls.PREFIX + f.name: f.name for f in fields(cls)}


def _section_from_dict(name: str, cls: type[Section], data: object) -> object:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name} must be a mapping of keys to values, got {data!r}")
    keys = section_keys(cls)
    for key in data:
        if key in NOT_YET:
            raise ConfigError(f"{name} key {key!r} (Accelerate's) {NOT_YET[key]}")
        if key not in keys:
            raise ConfigError(f"unknown {name} key {key!r}{did_you_mean(key, keys)}")
    return cls(**{keys[k]: v for k, v in data.items()}).validate()


# --- the run config --------------------------------------------------------------------------------------------
@dataclass
class RunConfig(Freezable):
    """Everything the launcher and the ranks need to know about the run."""

    compute_environment: str = option("LOCAL_MACHINE", "str", "impel runs on machines you start it on",
                                      choices=("LOCAL_MACHINE",))
    distributed_type: str | None = option(None, "str", "how to distribute; empty picks NO, MULTI_CPU or MULTI_GPU",
                                          choices=DISTRIBUTED_TYPES, question="Which kind of distribution")
    mixed_precision: str = option("no", "str", "autocast dtype for the forward pass", choices=MIXED_PRECISIONS,
                                  question="Mixed precision")
    gradient_accumulation_steps: int = option(1, "int", "micro-steps per optimizer step", minimum=1,
                                              question="Gradient accumulation steps")
    use_cpu: bool = option(False, "bool", "train on the CPU even when a GPU is present", flag="cpu",
                           question="Train on the CPU only")
    num_processes: int | None = option(None, "int", "total number of ranks over all machines", minimum=1,
                                       question="How many processes in total")
    num_machines: int = option(1, "int", "number of machines", minimum=1, question="How many machines")
    min_machines: int | None = option(None, "int", "elastic: the fewest machines the job trains on (torchrun "
                                      "--nnodes MIN:num_machines, c10d); a lost machine restarts the job on the "
                                      "others from the last checkpoint, the global batch kept", minimum=1)
    machine_rank: int = option(0, "int", "this machine's rank (0 runs the rendezvous)", minimum=0,
                               question="Rank of this machine")
    main_process_ip: str | None = option(None, "str", "address of the machine of rank 0",
                                         question="IP address of the machine of rank 0")
    main_process_port: int | None = option(None, "int", "port on the machine of rank 0 (default: a free one on "
                                           "one machine, 29500 on several)", minimum=1, maximum=65535,
                                           question="Port on the machine of rank 0")
    rdzv_backend: str = option("static", "str", "rendezvous: static (fixed ranks) or c10d (elastic)",
                               choices=("static", "c10d"), question="Rendezvous backend")
    same_network: bool = option(True, "bool", "several machines, static rendezvous: true passes torchrun "
                                "--master_addr/--master_port, false --rdzv_endpoint (as accelerate launch)")
    mpirun_hostfile: str | None = option(None, "str", "start the ranks with mpirun on the hosts of this MPI "
                                         "hostfile, num_processes / num_machines per host (as accelerate launch; "
                                         "Accelerate's mpirun_config.mpirun_hostfile)")
    gpu_ids: str | None = option(None, "str", "GPUs to use on each machine: 'all' or ids such as '0,1'")
    num_cpu_threads_per_process: int | None = option(None, "int", "OMP_NUM_THREADS for each rank", minimum=1)
    max_restarts: int = option(0, "int", "restarts of the whole job after a rank fails", minimum=0)
    monitor_interval: float = option(0.1, "float", "seconds between checks of the ranks' health", minimum=0.0)
    debug: bool = option(False, "bool", "Accelerate's debug mode: ranks get ACCELERATE_DEBUG_MODE=true, so "
                         "collectives check shapes across ranks first")
    auto_resume: bool = option(False, "bool", "load the newest complete checkpoint when training starts, and on "
                               "SIGTERM save one and exit 75 (needs a project_dir with automatic checkpoint naming)")
    async_save: bool = option(False, "bool", "save_state() returns once the state is staged in CPU memory; the "
                              "checkpoint is written and committed in the background")
    nonfinite_loss: str = option("ignore", "str", "a NaN/inf loss: 'error' stops naming the step, 'skip' skips "
                                 "that optimizer step on every rank", choices=("ignore", "error", "skip"))
    auto_model: str | None = option(None, "str", "distributed_type AUTO: the model to estimate (a transformers "
                                    "directory, 'GPT2Config(n_layer=12)' or module:callable)")
    device_memory: str | None = option(None, "str", "distributed_type AUTO: memory per device, e.g. 80GB (default: "
                                       "the GPU's, or this machine's RAM shared by its ranks)")
    fsdp_config: FSDPConfig | None = field(default=None, metadata={"section": FSDPConfig})
    deepspeed_config: DeepSpeedConfig | None = field(default=None, metadata={"section": DeepSpeedConfig})
    dynamo_config: DynamoConfig | None = field(default=None, metadata={"section": DynamoConfig})
    parallelism_config: ParallelismSection | None = field(default=None, metadata={"section": ParallelismSection})

    def __post_init__(self) -> None:
        self.explicit: dict[str, object] = {}

    def validate(self) -> RunConfig:
        check_distributed_type(self.distributed_type)
        _validate_fields(self)
        for name in SECTIONS:
            section = getattr(self, name)
            if section is not None:
                section.validate()
        self._check_combination()
        check_launch_values(self)
        return self

    def _check_combination(self) -> None:
        kind = self.distributed_type
        if self.deepspeed_config is not None and self.deepspeed_config.deepspeed_hostfile and kind != "DEEPSPEED":
            raise ConfigError(f"deepspeed_hostfile={self.deepspeed_config.deepspeed_hostfile!r} starts the ranks "
                              f"with DeepSpeed's runner, but distributed_type={kind!r}; add --use_deepspeed, or "
                              "use --mpirun_hostfile for a job without DeepSpeed")
        for name, owner in (("fsdp_config", "FSDP"), ("deepspeed_config", "DEEPSPEED")):
            if getattr(self, name) is not None and kind != owner:
                flag = "--use_fsdp" if owner == "FSDP" else "--use_deepspeed"
                raise ConfigError(f"{name} is set but distributed_type={kind!r}; set distributed_type: {owner} "
                                  f"({flag}) or remove {name}")
        if self.use_cpu and kind == "MULTI_GPU":
            raise ConfigError("use_cpu=true contradicts distributed_type='MULTI_GPU'; use MULTI_CPU or drop --cpu")
        if self.num_processes is not None and self.num_processes % self.num_machines:
            raise ConfigError(f"num_processes={self.num_processes} is not a multiple of num_machines="
                              f"{self.num_machines}; every machine runs the same number of processes")
        if self.min_machines is not None:
            check_elastic(self)
        if self.machine_rank >= self.num_machines:
            raise ConfigError(f"machine_rank={self.machine_rank} must be below num_machines={self.num_machines}")
        hostfile = self.mpirun_hostfile or self.deepspeed.deepspeed_hostfile  # rank 0: the hostfile's first host
        if self.num_machines > 1 and not self.main_process_ip and not hostfile:
            raise ConfigError(f"num_machines={self.num_machines} needs main_process_ip (the address of the machine "
                              "of rank 0); pass --main_process_ip")
        if kind == "AUTO" and not self.auto_model:
            raise ConfigError("distributed_type AUTO (--strategy auto) needs the model to estimate: pass --auto_model "
                              "(a transformers directory, 'GPT2Config(n_layer=12)' or module:callable)")
        if self.parallelism_config is not None:  # N-D parallelism: the sizes against the strategy and the world
            sizes = self.parallelism_config.sizes()
            check_strategy(sizes, kind)
            if self.num_processes is not None and total_size(sizes) > 1:
                check_world_size(sizes, self.num_processes, "num_processes")
        if kind == "NO" and self.num_processes not in (None, 1):
            raise ConfigError(f"distributed_type='NO' runs one process, not num_processes={self.num_processes}; "
                              "set distributed_type to MULTI_CPU/MULTI_GPU/FSDP/DEEPSPEED or num_processes: 1")

    @property
    def fsdp(self) -> FSDPConfig:
        return self.fsdp_config if self.fsdp_config is not None else FSDPConfig().validate()

    @property
    def deepspeed(self) -> DeepSpeedConfig:
        return self.deepspeed_config if self.deepspeed_config is not None else DeepSpeedConfig().validate()

    def with_values(self, **changes: Any) -> RunConfig:
        """A validated copy with ``changes`` applied (the explicitly set keys are kept)."""
        copy = dataclasses.replace(self, **changes)
        copy.explicit = dict(self.explicit)
        return copy.validate()

    def to_dict(self, explicit_only: bool = False) -> dict[str, Any]:
        """The config with Accelerate's YAML keys; ``explicit_only`` keeps only keys set by a file or a flag."""
        if explicit_only:
            return to_plain(self.explicit)
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS:
                value = None if value is None else {value.PREFIX + s.name: getattr(value, s.name)
                                                    for s in fields(value)}
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """Build and validate from Accelerate-style keys; unknown keys raise with a did-you-mean."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a config must be a mapping of keys to values, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                raise ConfigError(f"unknown config key {key!r}{did_you_mean(key, known)}")
        values = {k: v for k, v in data.items() if k not in SECTIONS}
        # Accelerate writes empty sections (`fsdp_config: {}`) for every distributed type: empty means absent
        sections: dict[str, Any] = {k: _section_from_dict(k, SECTIONS[k], v) if v else None
                                    for k, v in data.items() if k in SECTIONS}
        cfg = cls(**values, **sections)
        cfg.explicit = {k: v for k, v in data.items() if not (k in SECTIONS and not v)}
        cfg.validate()
        cfg.explicit = _normalised_explicit(cfg, cfg.explicit)
        return cfg


def _normalised_explicit(cfg: RunConfig, explicit: Mapping[str, Any]) -> dict[str, object]:
    """The explicitly given keys, with the validated (coerced) values."""
    full = cfg.to_dict()
    out: dict[str, Any] = {}
    for key, value in explicit.items():
        if key in SECTIONS:
            out[key] = {k: full[key][k] for k in value}
        else:
            out[key] = full[key]
    return out


def to_plain(data: Mapping[str, object]) -> dict[str, object]:
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}


def defaults() -> dict[str, object]:
    return {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}


def merge_code_arguments(launched: Mapping[str, Any] | None, code: Mapping[str, Any]) -> RunConfig:
    """Put the Accelerator's own arguments (None = not given) on top of the launched config. As in Accelerate, a
    code argument wins over a launched value (``false``, ``0``, ``""`` count as set) with one log line naming both
    (``accelerate config default`` writes ``mixed_precision: 'no'``; ``Accelerator(mixed_precision="bf16")`` still
    trains in bf16). It raises only where the launched topology cannot honour it: another strategy
    (``distributed_type``), ``cpu=True`` in a job launched on GPUs. Sections (``fsdp_config``) merge key by key."""
    base: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (launched or {}).items()}
    if code.get("use_cpu") is True and base.get("distributed_type") == "MULTI_GPU":
        raise ConfigError("the code sets cpu=True but the job was launched on GPUs (distributed_type=MULTI_GPU); "
                          "remove cpu=True or launch with --cpu")
    for key, value in code.items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            section = base.setdefault(key, {}) or {}
            base[key] = section
            for sub, sub_value in value.items():
                _merge_one(section, sub, sub_value, f"{key}.")
        else:
            _merge_one(base, key, value, "")
    return RunConfig.from_dict(base)


def _merge_one(target: dict[str, Any], key: str, value: Any, where: str) -> None:
    if value is None:
        return
    launched = target.get(key)
    if launched is not None and launched != value:
        if not where and key == "distributed_type":
            raise ConfigError(
                f"the code asks for distributed_type={value!r} (a plugin or argument) but the job was launched as "
                f"distributed_type={launched!r}; remove the plugin from the code or launch with the matching "
                "strategy (--use_fsdp, --use_deepspeed, ...)")
        logger.warning("the code sets %s%s=%r, which overrides the launched config's %s%s=%r", where, key, value,
                       where, key, launched)
    target[key] = value
