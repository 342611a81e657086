"""``impel env``: versions, devices and the resolved default config, ready to paste into a bug report."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata

from impel.config import environment as env
from impel.config.environment_settings import describe
from impel.config.run_config import ConfigError, RunConfig
from impel.config.yaml_file import dump_yaml, read_config_file


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("env", help="print versions, devices and the default config for a bug report")
    p.add_argument("--config_file", default=None, metavar="FILE")
    p.set_defaults(handler=main)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    import torch

    lines = [f"torch: {torch.__version__} (CUDA build {torch.version.cuda or 'none'})",
             f"CUDA available: {torch.cuda.is_available()}"]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                     f"capability {props.major}.{props.minor}")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        lines.append("MPS available: True")
    lines.append(f"CPU cores: {os.cpu_count()}")
    return lines


def _placement() -> str:
    """Which launcher's variables place this process (impel.config.cluster), as a rank of the job would read them."""
    try:
        topo = env.read_topology()
    except ValueError as exc:  # ConfigError included: launchers that disagree
        return f"launcher: {exc}"
    if not topo.distributed and topo.source == "single process":
        return "launcher: none found (a single process; torchrun, impel launch, mpirun, srun set the variables)"
    return (f"launcher: {topo.source}, rank {topo.rank} of {topo.world_size} (local {topo.local_rank} of "
            f"{topo.local_world_size}), rendezvous {topo.master_addr}:{topo.master_port}")


def main(ns: argparse.Namespace) -> int:
    from impel import __version__

    lines = [f"impel: {__version__}", f"Python: {sys.version.split()[0]} ({platform.platform()})"]
    lines += _devices()
    lines.append(_placement())
    if env.requested_device():
        lines.append(f"device named by ACCELERATE_TORCH_DEVICE: {env.requested_device()}")
    for dist in ("deepspeed", "transformers", "accelerate", "safetensors", "numpy"):
        lines.append(f"{dist}: {_version(dist)}")
    path, accelerates = env.config_to_read(ns.config_file)
    try:
        explicit = read_config_file(path) if (ns.config_file or os.path.isfile(path)) else {}
        where = path if explicit or ns.config_file else f"{path} (absent: defaults)"
        where += " (Accelerate's)" if accelerates else ""
        config = dump_yaml(RunConfig.from_dict(explicit).to_dict())
    except ConfigError as exc:
        where, config = path, f"invalid: {exc}\n"
    print("\n".join(f"- {line}" for line in lines))
    print(f"- config file: {where}\n\n```yaml\n{config}```")
    variables = describe()
    print("- environment variables that set the run (ACCELERATE_* / IMPEL_*; over the config file, under code "
          "arguments): " + ("none" if not variables else "\n" + "\n".join(f"  - {v}" for v in variables)))
    return 0
