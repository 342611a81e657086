"""Per-rank training memory on a ParallelismConfig mesh: dp_replicate x dp_shard x tp x cp (Accelerate's sizes).

The layout is Accelerate's (and torchtitan's): tensor parallel splits the parameters its plan names over the tp
ranks, then FSDP2 shards what each tp rank holds over the joint ``dp_shard_cp`` dimension (dp_shard x cp: context
parallel ranks shard the model too), and dp_replicate holds full copies of that shard (HSDP). With P parameters,
S of them split by the plan, a the load dtype's size and k optimizer states per parameter:

| | stored params | grads | optimizer states | transient |
|---|---|---|---|---|
| per tp rank | P_tp = P - S + S/tp | | | |
| FSDP over dp_shard x cp > 1 | P_tp * f / (dp_shard*cp) | same | k times that | 2 gathered units (tp-local) in c |
| no FSDP (tp only) | P_tp * a | P_tp * a | k * P_tp * a | |
| dp_replicate only (DDP) | P * a | P * a | k * P * a | P * a (gradient buckets) |

f is 4 with mixed precision (FSDP upcasts at prepare) else a, c the compute dtype's size. Activations: see
``estimate.activation_bytes`` (divided by cp, and by tp inside attention and the MLP).
"""
from __future__ import annotations

import math

from impel.commands.planning.estimate import (
    DTYPE_BYTES,
    OPTIMIZER_STATES,
    Estimate,
    ModelFacts,
    Setup,
    activation_bytes,
)
from impel.config.mesh_sizes import check_sizes
from impel.config.schema import ConfigError

SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")


def mesh_name(setup: Setup) -> str:
    """'FSDP x TP (dp_shard=2, tp=2)': the layout, then the sizes that are not 1."""
    r, d, t, c = (getattr(setup, k) for k in SIZES)
    parts = ["HSDP" if r > 1 and d > 1 else "FSDP" if d > 1 or c > 1 else "DDP" if r > 1 else ""]
    parts += ["TP"] * (t > 1) + ["CP"] * (c > 1)
    sizes = ", ".join(f"{k[:-5]}={v}" for k, v in zip(SIZES, (r, d, t, c)) if v != 1)
    return f"{' x '.join(p for p in parts if p)} ({sizes})"


def _divisors(n: int) -> str:
    found = [k for k in range(1, n + 1) if n % k == 0]
    return ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")


def check_mesh(facts: ModelFacts, setup: Setup) -> None:
    """Raise ConfigError naming the value and the fix when the mesh cannot hold this model on this many ranks."""
    sizes = {k: getattr(setup, k) for k in SIZES}
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    r, d, t, c = sizes.values()
    product = r * d * t * c
    if product != setup.world:
        others = r * t * c
        fix = (f"e.g. dp_shard_size {setup.world // others}" if setup.world % others == 0 else
               f"or --num_processes {product}")
        raise ConfigError(f"dp_replicate_size {r} x dp_shard_size {d} x tp_size {t} x cp_size {c} = {product} ranks, "
                          f"but --num_processes is {setup.world}: the product must equal the number of processes "
                          f"({fix})")
    check_sizes(sizes)  # the combinations no mesh can hold: the launcher's and the Accelerator's own rule
    if t > 1:
        if facts.tp is None:
            raise ConfigError(f"tp_size {t}: {facts.name} has no tensor-parallel plan (its config has no "
                              "base_model_tp_plan): pass one with --tp_plan '{\"module.path\": \"colwise\", ...}' "
                              "or set tp_size 1")
        needs = [(f"num_attention_heads ({n})", n) for n in (facts.heads,) if n]
        needs += [(f"num_key_value_heads ({n})", n) for n in (facts.kv_heads,) if n]
        needs += [(f"{n}, the dimension the plan splits in {where}", n) for where, n in facts.tp.split_dims]
        for what, n in needs:
            if n % t:
                common = math.gcd(*(n for _, n in needs))
                raise ConfigError(f"tp_size {t} does not divide {what}: tensor parallel splits it evenly over the "
                                  f"tp ranks; choose a tp_size that divides the heads and every dimension the plan "
                                  f"splits ({_divisors(common)})")
    if c > 1 and setup.seq_len and setup.seq_len % c:
        raise ConfigError(f"seq_len {setup.seq_len} is not divisible by cp_size {c}: context parallel splits the "
                          f"sequence evenly (torch balances the load with 2 x cp_size chunks: pad the sequence to a "
                          f"multiple of {2 * c})")


def estimate_mesh(facts: ModelFacts, setup: Setup) -> Estimate:
    """Per-rank bytes on the setup's mesh (check it first with check_mesh)."""
    r, d, t, c = (getattr(setup, k) for k in SIZES)
    k = OPTIMIZER_STATES[setup.optimizer]
    a = DTYPE_BYTES[setup.load_dtype]
    mp = setup.mixed_precision != "no"
    compute = 2 if mp else a
    split = facts.tp.sharded if (facts.tp and t > 1) else 0
    per_tp = facts.params - split + split / t
    units = (facts.tp.units if facts.tp and t > 1 else ()) or ((facts.largest_unit, 0),)
    unit = max(n - s + s / t for n, s in units)
    act = activation_bytes(facts, setup, compute)
    notes = [f"{style!r} on {module} counted as replicated" for module, style in (facts.tp.replicated
                                                                                  if facts.tp and t > 1 else ())]
    if t > 1 and facts.tp:
        notes.insert(0, f"tensor parallel plan from {facts.tp.source}: {split:,} of {facts.params:,} parameters "
                        f"split over {t} ranks, the rest replicated")
    shard = d * c
    if shard > 1:  # FSDP2 over dp_shard_cp; dp_replicate (HSDP) holds copies of the shard
        f = 4 if mp else a
        return Estimate(mesh_name(setup), per_tp * f / shard, per_tp * f / shard, k * per_tp * f / shard,
                        2 * unit * compute, act, notes=notes)
    buckets = per_tp * a if r > 1 else 0.0  # DDP's gradient buckets (dp_replicate without sharding or tp)
    return Estimate(mesh_name(setup), per_tp * a, per_tp * a, k * per_tp * a, buckets, act, notes=notes)
