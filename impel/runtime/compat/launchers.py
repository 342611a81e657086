"""Start a training function on several processes from Python (a notebook, a test): Accelerate's
``notebook_launcher`` and ``debug_launcher``, on torch's elastic agent as ``impel launch`` uses it.

The function runs in forked processes with torchrun's variables set, so ``Accelerator()`` inside it joins the
process group as under ``impel launch``. Create the Accelerator only inside the function.

Example::

    def train(lr):
        acc = Accelerator()
        ...

    notebook_launcher(train, args=(1e-3,), num_processes=2)
    debug_launcher(train, args=(1e-3,), num_processes=2)        # CPU ranks over gloo
"""
from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from impel.config import environment as env
from impel.config.run_config import ConfigError, PrecisionType


def _entrypoint(function: Callable[..., object]) -> Callable[..., None]:
    """What each (forked) rank runs: the user's function, then impel's process group is destroyed before the rank
    exits. Named after the function: the agent labels workers and events by it."""

    @functools.wraps(function)
    def run_rank(*args: object) -> None:
        function(*args)
        from impel.runtime.ranks.process import ProcessState

        if ProcessState._shared.get("initialized"):
            ProcessState().destroy_process_group()

    return run_rank


def _check_fresh_process(launcher: str) -> None:
    from impel.runtime.ranks.process import ProcessState

    if ProcessState._shared.get("initialized"):
        raise ConfigError(f"{launcher}: an Accelerator or PartialState already exists in this process, and forked "
                          "ranks would inherit it; create the Accelerator only inside the launched function (restart "
                          "the notebook kernel if a cell created one)")


def _launch(function: Callable[..., object], args: Sequence[Any], num_processes: int, config: dict[str, Any],
            rendezvous: dict[str, Any]) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(nproc_per_node=num_processes, start_method="fork", **rendezvous)
    with env.scoped_environ({env.CONFIG_VAR: json.dumps(config, sort_keys=True)}):
        elastic_launch(launch, _entrypoint(function))(*args)


def debug_launcher(function: Callable[..., object], args: Sequence[Any] = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` CPU ranks over gloo (for debugging and tests); returns when
    every rank is done and raises if one failed."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ConfigError(f"debug_launcher(num_processes={num_processes!r}) must be an integer >= 1")
    _check_fresh_process("debug_launcher")
    rendezvous = {"min_nodes": 1, "max_nodes": 1, "run_id": uuid.uuid4().hex, "rdzv_backend": "c10d",
                  "rdzv_endpoint": "127.0.0.1:0"}  # a free port, bound by the agent (static with port 0 hangs)
    _launch(function, args, num_processes, {"use_cpu": True, "num_processes": num_processes}, rendezvous)


def notebook_launcher(function: Callable[..., object], args: Sequence[Any] = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str | int = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: dict[str, Any] | None = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: str | None = None) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes per machine (one per GPU on a GPU machine, else CPU
    ranks over gloo) through torch's elastic agent; ``num_processes=1`` calls it in this process.

    ``mixed_precision`` reaches the Accelerator as a launched setting. The rendezvous arguments are torchrun's:
    ``use_port`` (``0``: a free port), ``master_addr``, ``node_rank`` / ``num_nodes`` (run the same call on every
    machine), ``rdzv_backend`` (static or c10d), ``rdzv_endpoint``, ``rdzv_conf``, ``rdzv_id``, ``max_restarts``,
    ``monitor_interval``, ``log_line_prefix_template``.
    """
    try:
        mode = PrecisionType(str(mixed_precision).lower())
    except ValueError:
        raise ConfigError(f"notebook_launcher(mixed_precision={mixed_precision!r}) is unknown; use 'no', 'fp16' or "
                          "'bf16'") from None
    if mode is PrecisionType.FP8:
        raise ConfigError("notebook_launcher(mixed_precision='fp8'): impel has no fp8 mode; use 'bf16' or 'fp16'")
    if num_processes is None:
        raise ConfigError("notebook_launcher needs num_processes=N (the processes to start on this machine)")
    if node_rank >= num_nodes:
        raise ConfigError(f"notebook_launcher(node_rank={node_rank}) must be below num_nodes={num_nodes}")
    if num_processes == 1 and num_nodes == 1:
        function(*args)  # nothing to launch: one process, this one
        return
    _check_fresh_process("notebook_launcher")
    config: dict[str, Any] = {"num_processes": num_processes * num_nodes, "num_machines": num_nodes}
    if mode is not PrecisionType.NO:
        config["mixed_precision"] = mode.value
    _launch(function, args, num_processes, config,
            _rendezvous(use_port, master_addr, node_rank, num_nodes, rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id,
                        max_restarts, monitor_interval, log_line_prefix_template))


def _rendezvous(use_port: str | int, master_addr: str, node_rank: int, num_nodes: int, rdzv_backend: str,
                rdzv_endpoint: str, rdzv_conf: dict[str, Any] | None, rdzv_id: str, max_restarts: int,
                monitor_interval: float, log_line_prefix_template: str | None) -> dict[str, Any]:
    """The elastic agent's LaunchConfig rendezvous fields, as Accelerate's notebook_launcher sets them."""
    if rdzv_backend not in ("static", "c10d"):
        raise ConfigError(f"notebook_launcher(rdzv_backend={rdzv_backend!r}) is unknown; use 'static' or 'c10d'")
    configs = dict(rdzv_conf or {})
    port = int(use_port)
    if port == 0 and num_nodes == 1 and not rdzv_endpoint:
        rdzv_backend, endpoint, rdzv_id = "c10d", f"{master_addr}:0", uuid.uuid4().hex  # static with port 0 hangs
    else:
        endpoint = rdzv_endpoint or f"{master_addr}:{port}"
        if rdzv_backend == "static":
            configs["rank"] = node_rank
    out: dict[str, Any] = {"min_nodes": num_nodes, "max_nodes": num_nodes, "run_id": rdzv_id,
                           "rdzv_backend": rdzv_backend, "rdzv_endpoint": endpoint, "rdzv_configs": configs,
                           "max_restarts": max_restarts, "monitor_interval": monitor_interval}
    if log_line_prefix_template is not None:
        out["log_line_prefix_template"] = log_line_prefix_template
    return out
