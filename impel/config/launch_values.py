"""Launcher settings that torch would take and fail on later with a traceback, or pass on unchecked (issue 36):
checked with the rest of the config, by ``impel launch`` and ``impel config validate``, before any rank starts.

Example::

    check_launch_values(RunConfig(gpu_ids="abc"))   # ConfigError: gpu_ids='abc' must be 'all' or GPU ids ...
"""
from __future__ import annotations

from typing import Any

from impel.config.schema import ConfigError


def check_launch_values(config: Any) -> None:
    """``gpu_ids``, ``monitor_interval`` and ``main_process_ip`` hold what the launcher can use."""
    ids = config.gpu_ids
    if ids is not None and str(ids).strip() != "all":
        parts = [p.strip() for p in str(ids).split(",")]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(f"gpu_ids={ids!r} must be 'all' or GPU ids separated by commas, such as 0,1 "
                              "(--gpu_ids 0,1): it becomes CUDA_VISIBLE_DEVICES of every rank")
    if not config.monitor_interval > 0:
        raise ConfigError(f"monitor_interval={config.monitor_interval} must be a number of seconds above 0 (how often "
                          "the launcher checks its ranks; the default is 0.1)")
    host = config.main_process_ip
    if host and host.count(":") == 1 and host.rpartition(":")[2].isdigit():  # one colon: not an IPv6 address
        name, _, port = host.rpartition(":")
        raise ConfigError(f"main_process_ip={host!r} includes a port; set main_process_ip: {name} and "
                          f"main_process_port: {port} (--main_process_ip {name} --main_process_port {port})")
