"""Per-rank training memory for every strategy, from the parameter count and the dtype flow of
docs/design.md ("Dtype flow").

Bytes per parameter, with k optimizer states per parameter (AdamW 2, SGD with momentum 1, plain SGD 0), W ranks,
a the load dtype's size (4 fp32, 2 bf16/fp16), c the compute dtype's size:

| strategy | stored params | grads | optimizer states | transient |
|---|---|---|---|---|
| DDP | a | a | k*a | a (the reducer's gradient buckets) |
| FSDP, no mixed precision | a / W | a / W | k*a / W | gathered units in a |
| FSDP, 16-bit mixed precision | 4 / W (upcast at prepare) | 4 / W | 4k / W | gathered units in c=2 |
| ZeRO-1/2/3, 16-bit mixed precision | 2 (/W at 3) | 2 (/W at 2, 3) | (4 + 4k) / W (fp32 master + states) | |
| ZeRO-1/2/3, no mixed precision | 4 (/W at 3) | 4 (/W at 2, 3) | (4 + 4k) / W (still a separate fp32 partition) | |

FSDP's NO_SHARD divides by 1, SHARD_GRAD_OP keeps the whole model gathered between forward and backward (P*c
transient), FULL_SHARD gathers one unit plus the prefetched next (2 x the largest unit); HYBRID shards within a
machine. Offload moves the sharded states to CPU RAM (FSDP: parameters, gradients and optimizer states;
DeepSpeed: the optimizer and master weights, plus parameters at ZeRO-3). Activations use the transformer estimate
of Korthikanti et al. (2022), per layer 34*s*b*h bytes at 16 bits (memory-efficient attention keeps no score
matrix), plus the logits; they need a
model config with layers/hidden/heads and are an approximation, not part of the measured 10% check.

A ParallelismConfig mesh (dp_replicate x dp_shard x tp x cp, Accelerate's sizes) is estimated in ``mesh.py``:
tensor parallel first (the parameters its plan splits hold 1/tp per rank, the rest is replicated), then FSDP2
over dp_shard x cp, replicated over dp_replicate; activations are divided by cp (the sequence is split) and,
inside attention and the MLP, by tp (by tp throughout with sequence parallel norms).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}
# cheapest first: less communication and fewer moving parts win when several fit
STRATEGIES = ("DDP", "ZeRO-1", "FSDP NO_SHARD", "ZeRO-2", "FSDP SHARD_GRAD_OP", "FSDP HYBRID_SHARD",
              "FSDP FULL_SHARD", "ZeRO-3", "ZeRO-2 + optimizer offload", "FSDP FULL_SHARD + offload",
              "ZeRO-3 + offload")


@dataclass
class TensorParallelFacts:
    """What a tensor-parallel plan does to a model's parameters (read from the plan and a meta-device instance).

    A parameter the plan splits holds 1/tp_size of its elements on each rank (colwise: a Linear's output dimension
    and its bias; rowwise: its input dimension, the bias stays whole; on an Embedding colwise splits the embedding
    dimension and rowwise the vocabulary); every other parameter (norms, and embeddings unless the plan names them)
    is replicated on every tp rank."""

    source: str  # where the plan came from: "the model's tp plan" or "the tp_plan passed"
    sharded: int  # parameters the plan splits over the tp ranks (tied weights once)
    units: tuple[tuple[int, int], ...] = ()  # (parameters, of which split) of each distinct unit FSDP gathers
    split_dims: tuple[tuple[str, int], ...] = ()  # (a parameter, the size of the dimension the plan splits)
    sequence_parallel: bool = False  # the plan splits the norms' activations over the sequence (SequenceParallel)
    logits_sharded: bool = False  # the output projection is split colwise and its output (the logits) stays split
    replicated: tuple[tuple[str, str], ...] = ()  # (module, style) of planned modules counted as replicated


@dataclass
class ModelFacts:
    """What the estimate needs to know about a model (read from a meta-device instance)."""

    name: str
    params: int
    largest_unit: int  # parameters of the largest unit FSDP gathers at once (a transformer layer, else the model)
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    kv_heads: int | None = None
    tp: TensorParallelFacts | None = None  # None: the model has no tensor-parallel plan


@dataclass
class Estimate:
    strategy: str
    params: float
    grads: float
    optimizer: float
    transient: float
    activations: float | None
    cpu: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def device_total(self) -> float:
        return self.params + self.grads + self.optimizer + self.transient + (self.activations or 0.0)

    def row(self, device_memory: float | None) -> dict[str, object]:
        gb = 1e9
        out = {"strategy": self.strategy, "params_GB": self.params / gb, "grads_GB": self.grads / gb,
               "optimizer_GB": self.optimizer / gb, "transient_GB": self.transient / gb,
               "activations_GB": None if self.activations is None else self.activations / gb,
               "per_rank_GB": self.device_total / gb, "cpu_GB": self.cpu / gb}
        if device_memory is not None:
            out["fits"] = self.device_total <= device_memory
        return out


@dataclass
class Setup:
    world: int
    machines: int = 1
    mixed_precision: str = "no"
    load_dtype: str = "fp32"
    optimizer: str = "adamw"
    batch_size: int | None = None
    seq_len: int | None = None
    # a ParallelismConfig's mesh (Accelerate's names); all 1: plain data parallelism, estimated per strategy
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1

    @property
    def mesh(self) -> bool:
        """True when a ParallelismConfig mesh is asked for (any of its sizes is not 1)."""
        return (self.dp_replicate_size, self.dp_shard_size, self.tp_size, self.cp_size) != (1, 1, 1, 1)


def activation_bytes(facts: ModelFacts, setup: Setup, compute_bytes: int) -> float | None:
    if not (setup.batch_size and setup.seq_len and facts.layers and facts.hidden):
        return None
    t = setup.tp_size
    s, b, h = setup.seq_len / setup.cp_size, setup.batch_size, facts.hidden  # context parallel splits the sequence
    # 34*s*b*h per layer at 16 bits; the 5*a*s^2*b attention-score term is left out because transformers'
    # default attention (SDPA / flash) does not store the score matrix. Tensor parallel splits the 24*s*b*h inside
    # attention and the MLP; the 10*s*b*h at the norms and residuals is split too only with sequence parallel.
    tp = facts.tp if t > 1 and facts.tp and facts.tp.sharded else None
    per_token = 34 if tp is None else 34 / t if tp.sequence_parallel else 10 + 24 / t
    per_layer = per_token * s * b * h * compute_bytes / 2
    logits = 2 * b * s * (facts.vocab or 0) * 4  # fp32 logits and their gradient
    if tp is not None and tp.logits_sharded:
        logits /= t
    return facts.layers * per_layer + logits


def estimate_all(facts: ModelFacts, setup: Setup) -> list[Estimate]:
    """One estimate per strategy, cheapest first."""
    k = OPTIMIZER_STATES[setup.optimizer]
    a = DTYPE_BYTES[setup.load_dtype]
    mp = setup.mixed_precision != "no"
    P, W = float(facts.params), setup.world
    local = max(W // max(setup.machines, 1), 1)
    c = 2 if mp else a
    act = activation_bytes(facts, setup, c)
    unit = 2 * facts.largest_unit * c
    out = [Estimate("DDP", P * a, P * a, k * P * a, P * a, act)]
    fp = 4 if mp else a  # FSDP upcasts to fp32 at prepare only with mixed precision
    for name, shard, transient in (("FSDP NO_SHARD", 1, unit if mp else 0.0),
                                   ("FSDP SHARD_GRAD_OP", W, P * c), ("FSDP FULL_SHARD", W, unit),
                                   ("FSDP HYBRID_SHARD", local, unit)):
        if name == "FSDP HYBRID_SHARD" and setup.machines <= 1:
            continue
        out.append(Estimate(name, P * fp / shard, P * fp / shard, k * P * fp / shard, transient, act))
    out.append(Estimate("FSDP FULL_SHARD + offload", 0.0, 0.0, 0.0, unit, act,
                        cpu=(2 + k) * P * fp / W, notes=["parameters, gradients and optimizer states in CPU RAM"]))
    dp = 2 if mp else 4  # DeepSpeed: 16-bit model weights with mixed precision, else fp32
    master = 4 + 4 * k  # measured: ZeRO keeps its own fp32 partition (master) even when the model is fp32
    for stage in (1, 2, 3):
        params = P * dp / (W if stage == 3 else 1)
        grads = P * dp / (W if stage >= 2 else 1)
        out.append(Estimate(f"ZeRO-{stage}", params, grads, master * P / W, unit if stage == 3 else 0.0, act))
    # ZeRO-Offload moves the gradient partitions to the CPU with the optimizer (the step runs there)
    out.append(Estimate("ZeRO-2 + optimizer offload", P * dp, 0.0, 0.0, 0.0, act, cpu=(master + dp) * P / W))
    out.append(Estimate("ZeRO-3 + offload", 0.0, 0.0, 0.0, unit, act, cpu=(master + 2 * dp) * P / W))
    return sorted(out, key=lambda e: STRATEGIES.index(e.strategy))


def parse_bytes(text: str) -> float:
    """'80GB', '80GiB', '512MB', '8e9' -> bytes."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9, "mb": 1e6, "kb": 1e3,
             "b": 1}
    raw = str(text).strip().lower().replace(" ", "")
    for suffix, scale in units.items():
        if raw.endswith(suffix):
            raw, factor = raw[: -len(suffix)], scale
            break
    else:
        factor = 1
    try:
        value = float(raw) * factor
    except ValueError:
        raise ValueError(f"device memory {text!r} is not a size; write it like 80GB, 24GiB or 8e9") from None
    if value <= 0:
        raise ValueError(f"device memory {text!r} must be positive")
    return value


def human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def recommend(estimates: list[Estimate], device_memory: float | None) -> tuple[Estimate | None, str]:
    """The cheapest strategy that fits, and why."""
    if device_memory is None:
        return None, "pass --device_memory to get a recommendation"
    for est in estimates:
        if est.device_total <= device_memory:
            return est, (f"{est.strategy} is the cheapest strategy that fits: {human(est.device_total)} per rank "
                         f"<= {human(device_memory)}")
    smallest = min(estimates, key=lambda e: e.device_total)
    return None, (f"nothing fits in {human(device_memory)} per rank; the smallest is {smallest.strategy} at "
                  f"{human(smallest.device_total)}: add ranks, or lower the batch size or sequence length "
                  "(activations)")


LAUNCH_FLAGS = {
    "DDP": [], "ZeRO-1": ["--use_deepspeed", "--zero_stage", "1"], "ZeRO-2": ["--use_deepspeed", "--zero_stage", "2"],
    "ZeRO-3": ["--use_deepspeed", "--zero_stage", "3"],
    "ZeRO-2 + optimizer offload": ["--use_deepspeed", "--zero_stage", "2", "--offload_optimizer_device", "cpu"],
    "ZeRO-3 + offload": ["--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "cpu",
                         "--offload_param_device", "cpu"],
    "FSDP NO_SHARD": ["--use_fsdp", "--fsdp_sharding_strategy", "NO_SHARD"],
    "FSDP SHARD_GRAD_OP": ["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"],
    "FSDP FULL_SHARD": ["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD"],
    "FSDP HYBRID_SHARD": ["--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD"],
    "FSDP FULL_SHARD + offload": ["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_offload_params"],
}
