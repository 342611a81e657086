"""The only module that reads or writes ``os.environ``.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT; ``impel launch``
adds one JSON variable, ``IMPEL_CONFIG``, holding the validated run config. Ranks never re-parse flags.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

CONFIG_VAR = "IMPEL_CONFIG"


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job, as torchrun describes it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; unset it or fix the launcher") from None


def read_topology(environ: Mapping[str, str] | None = None) -> Topology:
    """Read torchrun's variables; without them this is a single process."""
    env = os.environ if environ is None else environ
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    local_rank = _int(env, "LOCAL_RANK", rank if world > 1 else 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    port = env.get("MASTER_PORT")
    topo = Topology(rank, world, local_rank, local_world, env.get("MASTER_ADDR"), int(port) if port else None)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world} is not a valid placement; launch with torchrun or impel launch")
    return topo


def read_launch_config(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The run config ``impel launch`` validated and exported, or None when not launched by impel."""
    env = os.environ if environ is None else environ
    raw = env.get(CONFIG_VAR)
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{CONFIG_VAR} is not valid JSON ({exc}); relaunch with impel launch or unset it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_VAR} must hold a JSON object, got {type(data).__name__}")  # noqa: TRY004
    return data


def write_launch_config(config: Mapping[str, Any], environ: MutableMapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    env[CONFIG_VAR] = json.dumps(dict(config), sort_keys=True)


def default_config_path(environ: Mapping[str, str] | None = None) -> str:
    """Where ``impel config`` writes and ``impel launch`` reads: $IMPEL_CONFIG_FILE, else the XDG cache."""
    env = os.environ if environ is None else environ
    explicit = env.get("IMPEL_CONFIG_FILE")
    if explicit:
        return os.path.expanduser(explicit)
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "impel", "default_config.yaml")


def launch_environment(config: Mapping[str, Any], threads: int | None, gpu_ids: str | None,
                       ranks_per_machine: int = 1) -> dict[str, str]:
    """The variables ``impel launch`` sets for its ranks (merged into a copy of this process's environment).

    Several ranks on one machine get ``OMP_NUM_THREADS=1`` unless the user set it (torchrun does the same, with
    a warning banner); ``--num_cpu_threads_per_process`` sets it explicitly.
    """
    out = dict(os.environ)
    out[CONFIG_VAR] = json.dumps(dict(config), sort_keys=True)
    if threads is not None:
        out["OMP_NUM_THREADS"] = str(threads)
    elif ranks_per_machine > 1 and "OMP_NUM_THREADS" not in out:
        out["OMP_NUM_THREADS"] = "1"
    if gpu_ids not in (None, "all"):
        out["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    return out


def apply_environment(values: Mapping[str, str]) -> None:
    """Make ``values`` this process's environment (torchrun's agent passes it on to the ranks it starts)."""
    os.environ.update(values)
