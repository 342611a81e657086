"""The ``parallelism_config`` section: the sizes of the device mesh (Accelerate's ``ParallelismConfig``).

YAML keys and launch flags are Accelerate's: ``parallelism_config: {parallelism_config_tp_size: 2, ...}`` in a config
file, ``--parallelism_config_tp_size 2`` on ``impel launch``. The keywords of :class:`impel.ParallelismConfig` are
generated from these fields (``tp_size``, ...), so the YAML, the flags, ``impel config`` and the code share one
definition. :mod:`impel.config.run_config` holds the section as ``RunConfig.parallelism_config``; like it, this module
never
imports torch and imports nothing from impel but :mod:`impel.config.schema`.

The rules every spelling is checked against (:meth:`ParallelismSection.validate`, :func:`check_world_size`,
:func:`check_strategy`) live here, so a launch fails on the same text as a rank.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from impel.config.schema import ConfigError, Freezable, option, validate_fields

# torchtitan's / Accelerate's mesh order: the data-parallel dims outermost, tensor parallel innermost (fastest)
MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


@dataclass
class ParallelismSection(Freezable):
    """The ``parallelism_config`` section. YAML keys and flags carry a ``parallelism_config_`` prefix."""

    PREFIX = "parallelism_config_"

    dp_replicate_size: int = option(1, "int", "data-parallel replicas: plain DDP alone, the replicate dim of HSDP "
                                    "with dp_shard_size", minimum=1, question="Data-parallel replicate size "
                                    "(HSDP: replicas across nodes)")
    dp_shard_size: int = option(1, "int", "ranks FSDP shards parameters over (needs distributed_type FSDP)",
                                minimum=1, question="FSDP shard size")
    tp_size: int = option(1, "int", "tensor-parallel ranks (torch's ColwiseParallel / RowwiseParallel from the "
                          "model's plan)", minimum=1, question="Tensor-parallel size")
    cp_size: int = option(1, "int", "context-parallel ranks (torch's context_parallel; CUDA only)", minimum=1,
                          question="Context-parallel size (CUDA only)")
    cp_backend: str = option("torch", "str", "context-parallel backend", choices=("torch",))
    # TorchContextParallelConfig's field in code (ParallelismConfig(cp_handler=...)), a key of this section in YAML
    cp_comm_strategy: str = option("allgather", "str", "how context-parallel ranks exchange keys and values",
                                   choices=("allgather", "alltoall"), plugin=False)
    sp_size: int = option(1, "int", "DeepSpeed sequence parallelism (Ulysses): not supported, must be 1", minimum=1)
    sp_backend: str = option("deepspeed", "str", "sequence-parallel backend (Accelerate's; not supported)",
                             choices=("deepspeed",))

    def validate(self) -> ParallelismSection:
        validate_fields(self)
        check_sizes(self.sizes())
        return self

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SIZES}


def section_keys() -> dict[str, str]:
    """YAML key -> field name."""
    return {ParallelismSection.PREFIX + f.name: f.name for f in fields(ParallelismSection)}


def _named(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name}={sizes[name]}" for name in SIZES if name in sizes)


def total_size(sizes: dict[str, int]) -> int:
    total = 1
    for name in SIZES:
        total *= sizes.get(name, 1)
    return total


def check_sizes(sizes: dict[str, int]) -> None:
    """The combinations no mesh can hold, named (the product against the world size is :func:`check_world_size`)."""
    if sizes.get("sp_size", 1) > 1:
        raise ConfigError(f"sp_size={sizes['sp_size']}: DeepSpeed sequence parallelism (Ulysses / ALST, Accelerate's "
                          "sp_backend='deepspeed') is not supported by impel; use cp_size for context parallelism "
                          "on CUDA, or keep sp_size=1")
    replicate, shard = sizes.get("dp_replicate_size", 1), sizes.get("dp_shard_size", 1)
    tp, cp = sizes.get("tp_size", 1), sizes.get("cp_size", 1)
    if replicate > 1 and shard == 1 and (tp > 1 or cp > 1):
        raise ConfigError(f"dp_replicate_size={replicate} with dp_shard_size=1 and tp_size={tp}, cp_size={cp} is not "
                          "a valid mesh: tensor/context parallelism composes with FSDP, not with plain replication "
                          f"(DDP); set dp_shard_size={replicate} and dp_replicate_size=1 for FSDP x TP (2-D), or "
                          "set dp_shard_size > 1 with dp_replicate_size > 1 for HSDP x TP (3-D)")


def check_world_size(sizes: dict[str, int], world_size: int, where: str = "WORLD_SIZE") -> None:
    """The product of the sizes must be the number of processes (``where`` names what says so)."""
    total = total_size(sizes)
    if total != world_size:
        raise ConfigError(f"parallelism_config: {_named(sizes)} multiply to {total}, but {where}={world_size}; the "
                          "product of the sizes must equal the number of processes: change the sizes or the "
                          "number of processes")


def check_strategy(sizes: dict[str, int], distributed_type: object) -> None:
    """Which distributed types can run these sizes: FSDP shards over dp_shard x cp; DDP replicates (MULTI_CPU /
    MULTI_GPU run tensor parallelism alone, or plain replication); DeepSpeed runs none of them."""
    kind = None if distributed_type is None else str(distributed_type)
    if total_size(sizes) == 1:
        return
    if kind == "DEEPSPEED" and total_size(sizes) > sizes.get("dp_replicate_size", 1):
        raise ConfigError(f"parallelism_config ({_named(sizes)}) does not compose with DeepSpeed in impel; use FSDP "
                          "(--use_fsdp) for FSDP / HSDP x tensor parallelism, or remove the parallelism_config")
    if kind == "NO":
        raise ConfigError(f"parallelism_config ({_named(sizes)}) needs several processes, but distributed_type='NO'; "
                          "use FSDP or MULTI_CPU / MULTI_GPU")
    sharded = [f"{name}={sizes[name]}" for name in ("dp_shard_size", "cp_size") if sizes.get(name, 1) > 1]
    if sharded and kind != "FSDP":
        raise ConfigError(f"parallelism_config {' and '.join(sharded)} needs FSDP (it shards the model over the "
                          f"dp_shard x cp ranks), but distributed_type={kind!r}; launch with --use_fsdp (or pass "
                          "fsdp_plugin=FullyShardedDataParallelPlugin())")
    if kind == "FSDP" and not sharded:
        raise ConfigError(f"distributed_type FSDP with parallelism_config {_named(sizes)} leaves FSDP no dimension "
                          "to shard over (dp_shard_size and cp_size are 1); set dp_shard_size > 1, or run without "
                          "FSDP (MULTI_CPU / MULTI_GPU) for tensor parallelism alone")
