"""The only module that reads or writes ``os.environ``.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT (MPI, SLURM and other
launchers their own: :mod:`impel.config.cluster` reads them all, :func:`export_topology` writes torchrun's for
them); ``impel launch`` adds one JSON variable, ``IMPEL_CONFIG``, holding the validated run config. Ranks never
re-parse flags.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from impel.config import cluster
from impel.config.schema import ConfigError

if TYPE_CHECKING:
    from impel.config.mesh_sizes import ParallelismSection

CONFIG_VAR = "IMPEL_CONFIG"
_ENCODED = "base64:"


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job, as torchrun describes it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int | None = None  # set by torchrun's elastic agent: 0 on the first attempt
    agent_store: bool = False  # the agent hosts the TCPStore (ranks connect as clients)
    source: str = "single process"  # the launcher whose variables placed this process (impel.config.cluster)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def read_topology(environ: Mapping[str, str] | None = None) -> Topology:
    """Read the launcher's variables (torchrun's, MPI's, SLURM's, ...: :mod:`impel.config.cluster`); without any,
    this is a single process."""
    env = os.environ if environ is None else environ
    placement = cluster.settle(env)
    if placement is None:
        return Topology()
    rank, world = placement.rank, placement.world_size
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{placement.source}: rank {rank} of world size {world} is not a valid placement; launch "
                         "with torchrun, impel launch, mpirun or srun")
    if placement.source == "torchrun":
        port = env.get("MASTER_PORT")
        addr, master_port = env.get("MASTER_ADDR"), int(port) if port else None
    else:
        addr, master_port = cluster.rendezvous(env, placement)
    restarts = env.get("TORCHELASTIC_RESTART_COUNT")
    return Topology(rank, world, placement.local_rank, placement.local_world_size, addr, master_port,
                    int(restarts) if restarts not in (None, "") else None,
                    env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", placement.source)


def export_topology(topology: Topology, environ: MutableMapping[str, str] | None = None) -> None:
    """A job placed by another launcher than torchrun: torchrun's variables for what reads them (torch's ``env://``
    rendezvous, scripts reading ``LOCAL_RANK``), as Accelerate sets them; the values given are left as they are."""
    env = os.environ if environ is None else environ
    values = {"RANK": topology.rank, "WORLD_SIZE": topology.world_size, "LOCAL_RANK": topology.local_rank,
              "LOCAL_WORLD_SIZE": topology.local_world_size, "MASTER_ADDR": topology.master_addr,
              "MASTER_PORT": topology.master_port}
    for name, value in values.items():
        if value is not None and not env.get(name):
            env[name] = str(value)


def read_launch_config(environ: Mapping[str, str] | None = None) -> dict[str, object] | None:
    """The run config ``impel launch`` validated and exported, or None when not launched by impel."""
    env = os.environ if environ is None else environ
    raw = env.get(CONFIG_VAR)
    if not raw:
        return None
    if raw.startswith(_ENCODED):  # as DeepSpeed's runner forwards it (impel.commands.deepspeed_runner)
        raw = base64.urlsafe_b64decode(raw[len(_ENCODED):]).decode("utf-8")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{CONFIG_VAR} is not valid JSON ({exc}); relaunch with impel launch or unset it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_VAR} must hold a JSON object, got {type(data).__name__}")  # noqa: TRY004
    return data


def encode_launch_config(raw: str) -> str:
    """``IMPEL_CONFIG``'s JSON in letters, digits and ``_-=:`` only (read back by :func:`read_launch_config`)."""
    return _ENCODED + base64.urlsafe_b64encode(raw.encode("utf-8")).decode("ascii")


def deepspeed_env_file_name() -> str:
    """The name of the environment file DeepSpeed's runner reads from ``~`` and ``.`` (``$DS_ENV_FILE``)."""
    return os.environ.get("DS_ENV_FILE", ".deepspeed_env")


def write_launch_config(config: Mapping[str, object], environ: MutableMapping[str, str] | None = None) -> None:
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


def config_path_to_write(environ: Mapping[str, str] | None = None) -> str:
    """Where ``impel config`` writes without ``--config_file``: :func:`default_config_path`, checked when
    $IMPEL_CONFIG_FILE names it (a directory raises)."""
    env = os.environ if environ is None else environ
    path = default_config_path(env)
    if env.get("IMPEL_CONFIG_FILE"):
        check_config_variable(path, reading=False)
    return path


def check_config_variable(path: str, reading: bool) -> None:
    """$IMPEL_CONFIG_FILE (resolved to ``path``) must name a file: a ConfigError naming the variable, the path
    and the fix when it is a directory, or (``reading``: a command that reads the config) when it is missing."""
    if os.path.isdir(path):
        raise ConfigError(f"IMPEL_CONFIG_FILE={path} is a directory, not a file; point it at the YAML file itself "
                          f"(e.g. {os.path.join(path, 'default_config.yaml')}) or unset it")
    if reading and not os.path.isfile(path):
        raise ConfigError(f"IMPEL_CONFIG_FILE={path} does not exist; write it with `impel config` (or `impel config "
                          "default`), point the variable at an existing file, or unset it to use the defaults")


def accelerate_config_path(environ: Mapping[str, str] | None = None) -> str:
    """Where Accelerate keeps its default config: $HF_HOME (else $XDG_CACHE_HOME/huggingface, else
    ~/.cache/huggingface) /accelerate/default_config.yaml (or .json, which Accelerate also writes)."""
    env = os.environ if environ is None else environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    folder = os.path.join(os.path.expanduser(home), "accelerate")
    yaml_path = os.path.join(folder, "default_config.yaml")
    json_path = os.path.join(folder, "default_config.json")
    return json_path if not os.path.isfile(yaml_path) and os.path.isfile(json_path) else yaml_path


def config_to_read(named: str | None = None, environ: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """The config file a command reads (``named`` when given) and whether it is Accelerate's: impel's own
    (:func:`default_config_path`) when it exists or was named by $IMPEL_CONFIG_FILE, else Accelerate's default
    file when that exists (a user moving over keeps it), else impel's (absent: defaults)."""
    if named:
        return named, False
    env = os.environ if environ is None else environ
    own = default_config_path(env)
    if env.get("IMPEL_CONFIG_FILE"):
        check_config_variable(own, reading=True)
        return own, False
    if os.path.isfile(own):
        return own, False
    theirs = accelerate_config_path(env)
    return (theirs, True) if os.path.isfile(theirs) else (own, False)


def requested_device() -> str | None:
    """The device ``ACCELERATE_TORCH_DEVICE`` (or ``IMPEL_TORCH_DEVICE``) names, as Accelerate reads it (Ray Train
    sets it on every worker); None when unset."""
    for name in ("IMPEL_TORCH_DEVICE", "ACCELERATE_TORCH_DEVICE"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def read_variables(names: Iterable[str]) -> dict[str, str]:
    """The variables among ``names`` that are set and not empty (blank counts as unset), in ``names``' order."""
    found = {name: os.environ.get(name, "") for name in names}
    return {name: value for name, value in found.items() if value.strip()}


def parallelism_variables(names: list[str]) -> dict[str, str]:
    """Accelerate's launcher variables for ``ParallelismConfig`` (``PARALLELISM_CONFIG_TP_SIZE`` for ``tp_size``),
    by field name: only those set and not empty."""
    found = {name: os.environ.get("PARALLELISM_CONFIG_" + name.upper(), "") for name in names}
    return {name: value for name, value in found.items() if value.strip()}


def parallelism_exports(section: ParallelismSection) -> dict[str, str]:
    """What ``accelerate launch`` tells its ranks of the ``parallelism_config`` section, by field name
    (``tp_size`` -> ``PARALLELISM_CONFIG_TP_SIZE``): ``ParallelismConfig()`` reads these, under impel as under
    Accelerate, so the launched sizes reach the code without it reading the launch config."""
    values = {f.name: getattr(section, f.name) for f in fields(section)}
    return {"PARALLELISM_CONFIG_" + name.upper(): str(value) for name, value in values.items() if value is not None}


def launch_environment(config: Mapping[str, object], threads: int | None, gpu_ids: str | None,
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
    if config.get("min_machines") is not None:
        # elastic: torch's agent otherwise keeps the worker store on the machine that was rank 0 in the first round
        # for every later round (and the ranks' keys across restarts): losing that machine would hang the rest.
        # Unshared, each round's rank 0 hosts a fresh store for its ranks.
        out["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return out


def changed_names(values: Mapping[str, str]) -> list[str]:
    """The names in ``values`` that this process's environment lacks or holds otherwise (what a launcher that
    forwards only named variables, Open MPI's ``mpirun -x``, must be told), sorted."""
    return sorted(k for k, v in values.items() if os.environ.get(k) != v)


def apply_environment(values: Mapping[str, str]) -> None:
    """Make ``values`` this process's environment (torchrun's agent passes it on to the ranks it starts)."""
    os.environ.update(values)


def announce_fsdp_ram_efficient_loading() -> None:
    """Tell transformers' ``from_pretrained`` (Accelerate's variables) that only local rank 0 reads real weights.

    Set by the FSDP strategy, i.e. when the Accelerator is created: build the Accelerator before the model.

    Process-wide on purpose (not scoped like ``DS_ACCELERATOR``): the reader is the user's own
    ``from_pretrained`` call, which comes *after* the Accelerator exists, outside any block impel controls; under
    Accelerate the same two variables come from ``accelerate launch`` and live as long as the process too. Only an
    FSDP Accelerator with ``cpu_ram_efficient_loading`` sets them (see docs/design.md, "RAM-efficient loading").
    """
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block, then restore each variable (or remove it) as it was."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_SET_FOR_DEEPSPEED: set[str] = set()  # variables impel set for DeepSpeed where the process had none


def release_deepspeed_environment() -> None:
    """At the end of a DeepSpeed run: remove what :func:`deepspeed_import_environment` set where the process had
    nothing (``LOCAL_RANK``), so code after the run does not take the process for a launched rank (transformers'
    ``TrainingArguments`` building Accelerate's ``PartialState`` would start a process group from it)."""
    while _SET_FOR_DEEPSPEED:
        os.environ.pop(_SET_FOR_DEEPSPEED.pop(), None)


@contextlib.contextmanager
def deepspeed_import_environment(device_type: str, local_rank: int) -> Iterator[None]:
    """What DeepSpeed reads from the environment, for the block that imports it.

    ``DS_ACCELERATOR`` must match impel's device, and DeepSpeed reads it once, in the first ``get_accelerator()``
    (cached afterwards): it is set around that import only, then the user's value (or its absence) is back, so it
    does not leak into later code or the subprocesses the script starts. ``LOCAL_RANK`` stays set where it was
    missing (a plain process: 0): DeepSpeed's engine asserts it later, in ``deepspeed.initialize``; the strategy's
    teardown removes it again (:func:`release_deepspeed_environment`).
    """
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local_rank)
        _SET_FOR_DEEPSPEED.add("LOCAL_RANK")
    with scoped_environ({"DS_ACCELERATOR": device_type} if device_type in ("cpu", "cuda") else {}):
        yield


@contextlib.contextmanager
def forced_weights_only_load() -> Iterator[None]:
    """Every ``torch.load`` in this block runs with ``weights_only=True``, even where a library (DeepSpeed's
    checkpoint readers) asks for ``weights_only=False``: torch's own ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` switch."""
    with scoped_environ({"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}):
        yield


def accelerate_log_level() -> str | None:
    """The level ``get_logger`` applies when none is given: ``$IMPEL_LOG_LEVEL``, else Accelerate's
    ``$ACCELERATE_LOG_LEVEL``, else None."""
    return os.environ.get("IMPEL_LOG_LEVEL") or os.environ.get("ACCELERATE_LOG_LEVEL") or None


def mlflow_overrides() -> dict[str, str]:
    """Accelerate's MLflow variables that win over ``MLflowTracker``'s arguments, keyed by argument name
    (``experiment_name``, ``run_id``, ``tags``, ``nested_run``): only the variables that are set."""
    names = {"experiment_name": "MLFLOW_EXPERIMENT_NAME", "run_id": "MLFLOW_RUN_ID", "tags": "MLFLOW_TAGS",
             "nested_run": "MLFLOW_NESTED_RUN"}
    return {arg: os.environ[var] for arg, var in names.items() if var in os.environ}


def cxx_compiler() -> str | None:
    """``$CXX``, the C++ compiler the user chose (torch's inductor compiles with it), or None when unset."""
    return os.environ.get("CXX")


def staging_dir() -> str | None:
    """``$IMPEL_STAGING_DIR``: where saves to object storage are written before their upload (None: unset)."""
    return os.environ.get("IMPEL_STAGING_DIR") or None


def read_flag(name: str, default: bool = False) -> bool:
    """A yes/no variable (``1/true/yes/on`` vs ``0/false/no/off``); ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "y", "on"):
        return True
    if raw in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a yes/no value; use 1/true or 0/false")



STALL_WARNING_VAR = "IMPEL_STALL_WARNING"  # seconds a rank may wait for its peers before the watchdog says so
DEFAULT_STALL_WARNING_S = 60.0
RANK_EXIT_DIR_VAR = "IMPEL_RANK_EXIT_DIR"  # where ``impel launch``'s ranks note a normal exit (who left first)


def stall_warning_seconds() -> float:
    """``$IMPEL_STALL_WARNING`` (``impel launch --stall_warning``): seconds; 0 turns the watchdog off."""
    raw = os.environ.get(STALL_WARNING_VAR, "").strip()
    if not raw:
        return DEFAULT_STALL_WARNING_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"environment variable {STALL_WARNING_VAR}={raw!r} is not a number of seconds >= 0; set "
                         f"e.g. {STALL_WARNING_VAR}=60, or 0 to turn the stall watchdog off")
    return value


def restarts_left(environ: Mapping[str, str] | None = None) -> int:
    """Restarts torchrun's agent still has for this job (``TORCHELASTIC_MAX_RESTARTS`` minus this attempt's
    ``TORCHELASTIC_RESTART_COUNT``); 0 when not under torchrun or unreadable."""
    env = os.environ if environ is None else environ
    try:
        return max(0, int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def rank_exit_dir() -> str | None:
    """The folder ``impel launch`` gave its ranks to note a normal exit in, or None outside it."""
    return os.environ.get(RANK_EXIT_DIR_VAR) or None


# --- Accelerate's environment utilities (``accelerate.utils.environment``): scripts' and test suites' helpers -----
def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Accelerate's truth parser: ``y/yes/t/true/on/1`` -> 1, ``n/no/f/false/off/0`` -> 0 (bools with ``to_bool``)."""
    lowered = value.lower()
    if lowered in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if lowered in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}; use one of y/yes/t/true/on/1 or n/no/f/false/off/0")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether ``$key`` holds a true value (:func:`str_to_bool`); ``default`` when unset."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """``$key``, or ``default`` when unset."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: Iterable[str], default: int) -> int:
    """The first of ``env_keys`` set to a non-negative integer, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


@contextlib.contextmanager
def patch_environment(**kwargs: object) -> Iterator[None]:
    """Set each keyword (upper-cased, its value as a string) in ``os.environ`` for the block, then put back what was
    there (or remove it)."""
    with scoped_environ({key.upper(): str(value) for key, value in kwargs.items()}):
        yield


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """An empty ``os.environ`` for the block; afterwards the environment is exactly what it was before."""
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def restored_prefix(prefix: str) -> Iterator[None]:
    """The variables starting with ``prefix`` are, after the block, what they were before it (new ones removed)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(prefix)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(prefix)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)
