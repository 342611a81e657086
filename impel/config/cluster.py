"""Where this process sits in the job, from whichever launcher started it (read by ``environment.read_topology``).

Each launcher describes a rank in its own variables; impel reads them all, in one place:

============================  ====================================================================================
launcher                      variables (rank, size, local rank, local size)
============================  ====================================================================================
torchrun / ``impel launch``   ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (DeepSpeed's runner:
                              ``LOCAL_SIZE``; also a Kubeflow PyTorchJob, whose pods get ``RANK`` / ``WORLD_SIZE``:
                              one process per pod, local rank 0)
OpenMPI ``mpirun``            ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``
MPICH / Intel MPI (Hydra)     ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
MVAPICH                       ``MV2_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``
SLURM ``srun``                ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), ``SLURM_LOCALID``,
                              the tasks on this node from ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``
LSF ``jsrun``                 ``JSM_NAMESPACE_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``
============================  ====================================================================================

torchrun's variables win when torchrun started the process (``TORCHELASTIC_RUN_ID``; under ``mpirun torchrun``
the MPI variables count the agents, not the ranks). Otherwise every launcher found must agree on rank and size, or
:class:`ConfigError` names both. ``MASTER_ADDR`` / ``MASTER_PORT`` are read as given; without them a job whose
ranks all run on this machine uses ``127.0.0.1`` and port 29500 (an srun step: the first host of its node list
and a port from the job id), and one that spans machines raises naming the variables to set.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from impel.config.schema import ConfigError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Placement:
    """A rank as one launcher's variables describe it."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


# launcher -> (rank, size, local rank, local size) variables; torchrun's first
_MPI_LIKE = {
    "OpenMPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "MPICH / Intel MPI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "MVAPICH": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_SIZE"),
    "LSF jsrun": ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK",
                  "JSM_NAMESPACE_LOCAL_SIZE"),
}


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; unset it or fix the "
                          "launcher") from None


def placements(env: Mapping[str, str]) -> list[Placement]:
    """Every launcher whose variables are set, torchrun's first."""
    found: list[Placement] = []
    world, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
    if world is not None and rank is not None:
        kubeflow = "LOCAL_RANK" not in env and "TORCHELASTIC_RUN_ID" not in env and "KUBERNETES_SERVICE_HOST" in env
        local = _int(env, "LOCAL_RANK")
        found.append(Placement("Kubeflow PyTorchJob" if kubeflow else "torchrun", rank, world,
                               0 if kubeflow else (local if local is not None else (rank if world > 1 else 0)),
                               1 if kubeflow else (_int(env, "LOCAL_WORLD_SIZE") or _int(env, "LOCAL_SIZE")
                                                   or world)))
    for source, names in _MPI_LIKE.items():
        rank, world = _int(env, names[0]), _int(env, names[1])
        if rank is not None and world is not None:
            local, local_world = _int(env, names[2]), _int(env, names[3])
            found.append(Placement(source, rank, world, local if local is not None else rank,
                                   local_world if local_world is not None else world))
    slurm = _slurm(env)
    if slurm is not None:
        found.append(slurm)
    return found


def _slurm(env: Mapping[str, str]) -> Placement | None:
    """An srun step's task (``SLURM_STEP_ID`` set: a batch script's own shell is not a rank of a job)."""
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    if rank is None or world is None or "SLURM_STEP_ID" not in env:
        return None
    local = _int(env, "SLURM_LOCALID")
    per_node = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "",
                              _int(env, "SLURM_NODEID") or 0)
    return Placement("SLURM srun", rank, world, local if local is not None else 0, per_node or world)


def _tasks_on_node(spec: str, node: int) -> int | None:
    """SLURM's ``2(x3),1`` (2 tasks on each of 3 nodes, then 1): the count on node ``node``."""
    seen = 0
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if node < seen + repeat:
            return count
        seen += repeat
    return None


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return None
    prefix, ranges = match.group(1), match.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def settle(env: Mapping[str, str]) -> Placement | None:
    """This process's placement (None: no launcher's variables: a single process); a ConfigError when two
    launchers disagree."""
    found = placements(env)
    if not found:
        return None
    first = found[0]
    if first.source == "torchrun" and "TORCHELASTIC_RUN_ID" in env:
        return first  # torchrun started this process; other launchers' variables describe its agents
    for other in found[1:]:
        if (other.rank, other.world_size) != (first.rank, first.world_size):
            raise ConfigError(f"the launchers' variables disagree: {first.source} says rank {first.rank} of "
                              f"{first.world_size}, {other.source} says rank {other.rank} of {other.world_size}; "
                              "start each process with one launcher (or unset the stale variables, e.g. RANK / "
                              "WORLD_SIZE exported by hand)")
    return first


def rendezvous(env: Mapping[str, str], placement: Placement) -> tuple[str | None, int | None]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` for a placement not from torchrun: as given, else defaults where every
    rank can derive the same ones (see the module docstring), else a ConfigError naming what to set."""
    port_raw = env.get("MASTER_PORT")
    addr, port = env.get("MASTER_ADDR"), int(port_raw) if port_raw else None
    if placement.world_size < 2 or (addr and port):
        return addr, port
    if placement.source == "SLURM srun":
        host = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "")
        job = _int(env, "SLURM_JOB_ID") or 0
        return addr or host, port or 10000 + job % 20000
    if placement.local_world_size == placement.world_size:  # every rank on this machine
        return addr or "127.0.0.1", port or DEFAULT_PORT
    raise ConfigError(f"{placement.source} started rank {placement.rank} of {placement.world_size} across "
                      "machines but MASTER_ADDR / MASTER_PORT are not set; pass them to every rank (mpirun -x "
                      "MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ...)")
