"""Elastic jobs (``impel launch --nnodes MIN:MAX``, config keys ``min_machines`` and ``num_machines``): the rules
the launcher checks before any rank starts and every rank applies when it starts.

A job planned for ``num_machines`` machines keeps training on as few as ``min_machines``: when a machine is lost,
torchrun's elastic agent (c10d rendezvous) restarts the ranks on the machines left, and they resume from the last
checkpoint. The global batch (per-rank batch x gradient accumulation x world size) is kept by raising the
accumulation: ``steps x planned world / world``, which must be a whole number for every world the job can shrink
to (:func:`scaled_accumulation`); the launcher refuses a combination where it is not (:func:`check_elastic_batch`).

Example::

    scaled_accumulation(1, planned_world=2, world=1)    # 2
    smallest_steps(2, 3)                                  # 2: 2 x 3 / 2 = 3 steps on 2 machines
"""
from __future__ import annotations

import math
from typing import Any

from impel.config.schema import ConfigError


def check_elastic(config: Any) -> None:
    """The elastic keys of a run config agree with each other (``RunConfig.validate``)."""
    low, high = config.min_machines, config.num_machines
    if low > high:
        raise ConfigError(f"min_machines={low} is above num_machines={high}; an elastic job trains on "
                          "min_machines to num_machines machines: pass --nnodes MIN:MAX with MIN <= MAX")
    if config.rdzv_backend == "static" and "rdzv_backend" in config.explicit:
        raise ConfigError(f"min_machines={low} (an elastic job, --nnodes {low}:{high}) needs the c10d rendezvous, "
                          "which admits machines that join or leave; set rdzv_backend: c10d (--rdzv_backend c10d) "
                          "or remove min_machines")
    if config.distributed_type == "DEEPSPEED":
        raise ConfigError(f"min_machines={low} (elastic) is not supported with DeepSpeed (its engine fixes the "
                          "batch sizes of its JSON for one world size); use DDP or FSDP, or remove min_machines")
    if config.parallelism_config is not None:
        raise ConfigError(f"min_machines={low} (elastic) cannot be combined with parallelism_config: its mesh "
                          "sizes are fixed for one world size; remove one of them")


_MOST_STEPS = 10**6  # an accumulation above this is no plan: the launcher asks for a narrower MIN:MAX instead


def smallest_steps(low: int, high: int) -> int | None:
    """The smallest accumulation that keeps the global batch exactly on every machine count from ``low`` to
    ``high`` (``steps x high / n`` whole for each ``n``); None when it is above a million (a wide range: 1:64
    needs about 10**25)."""
    out = 1
    for n in range(low, high + 1):
        need = n // math.gcd(high, n)
        out = out * need // math.gcd(out, need)
        if out > _MOST_STEPS:
            return None
    return out


def check_elastic_launch(config: Any) -> None:
    """What ``impel launch`` (and ``impel config validate``) check of an elastic job before any rank starts: it
    restarts its ranks when a machine is lost, and keeps its global batch on each machine count."""
    if config.min_machines is None:
        return
    if config.max_restarts < 1:
        raise ConfigError(f"an elastic job (--nnodes {config.min_machines}:{config.num_machines}) continues after a "
                          "machine is lost by restarting its ranks from the last checkpoint: set --max_restarts N "
                          "(N >= 1, the failures it may survive)")
    check_elastic_batch(config.gradient_accumulation_steps, config.min_machines, config.num_machines)


def check_elastic_batch(steps: int, low: int, high: int) -> None:
    """Before any rank starts: ``steps`` keeps the global batch on every machine count the job can run on."""
    for n in range(low, high):
        if steps * high % n:
            least = smallest_steps(low, high)
            if least is None:
                raise ConfigError(f"--nnodes {low}:{high}: no gradient_accumulation_steps up to {_MOST_STEPS} keeps "
                                  f"the global batch on every machine count from {low} to {high} (on {n} machines "
                                  f"{steps} x {high} / {n} micro-steps is not a whole number); raise MIN closer to "
                                  f"MAX (with gradient_accumulation_steps={steps}: --nnodes "
                                  f"{_narrower(high, steps)}:{high})")
            raise ConfigError(f"gradient_accumulation_steps={steps} cannot keep the global batch when the job "
                              f"planned for {high} machines runs on {n} ({steps} x {high} / {n} micro-steps is "
                              f"not a whole number); set gradient_accumulation_steps to a multiple of {least}, or "
                              f"raise min_machines")


def _narrower(high: int, steps: int) -> int:
    """The smallest MIN for which ``steps`` keeps the global batch on every count from MIN to ``high``."""
    low = high
    while low > 1 and steps * high % (low - 1) == 0:
        low -= 1
    return low


def scaled_accumulation(steps: int, planned_world: int, world: int) -> int:
    """The accumulation that keeps ``micro x steps x planned_world`` on ``world`` processes; a ConfigError naming
    the numbers when it is not a whole number."""
    if steps * planned_world % world:
        raise ConfigError(f"elastic job on {world} of its {planned_world} planned processes: gradient accumulation "
                          f"{steps} x {planned_world} / {world} is not a whole number, so the global batch cannot "
                          f"be kept exactly; use a gradient_accumulation_steps that makes it one (a multiple of "
                          f"{world // math.gcd(planned_world, world)}), or raise min_machines")
    return steps * planned_world // world
