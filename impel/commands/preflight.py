"""Checks ``impel launch`` makes before torchrun's agent starts, where the agent would hang or print a traceback.

- ``--main_process_ip`` must resolve: torch's c10d retries an unknown host with back-off and no end (issue 27:
  no error after 300 s). Resolution runs in a thread bounded by :data:`RESOLVE_TIMEOUT_S`, so a dead DNS server
  cannot hang the launcher either.
- The rendezvous port must be free on the machine that hosts it (machine rank 0): otherwise the agent's
  TCPStore fails after seconds with a ``DistNetworkError ... EADDRINUSE`` traceback.
"""
from __future__ import annotations

import errno
import socket
import threading

from impel.config.run_config import ConfigError, RunConfig

RESOLVE_TIMEOUT_S = 1.0


def check_rendezvous(config: RunConfig) -> None:
    """Raise a ConfigError naming the host or port when the rendezvous cannot work; nothing is started here."""
    host = config.main_process_ip
    if host:
        resolve(host)
    port = config.main_process_port
    if port is not None and config.machine_rank == 0:
        check_port_free(port)


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT_S) -> None:
    """``host`` resolves to an address within ``timeout`` seconds, else a ConfigError naming it."""
    outcome: dict[str, BaseException | None] = {}

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            outcome["error"] = None
        except (OSError, UnicodeError) as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=look_up, name="impel-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" not in outcome:
        raise ConfigError(f"--main_process_ip {host} could not be resolved within {timeout:g} s (is the name server "
                          "reachable?); pass the IP address of the machine of rank 0")
    error = outcome["error"]
    if error is not None:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"--main_process_ip {host} cannot be resolved ({why}); pass the IP address or a host name "
                          "of the machine of rank 0 that this machine can resolve")


def check_port_free(port: int) -> None:
    """Machine rank 0 hosts the rendezvous on ``port``: it must be free here (bound as torch's TCPStore binds it)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is usable, as for torch
            try:
                probe.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"--main_process_port {port} is already in use on this machine (another job, "
                                      "or an earlier impel launch still running?); pick another port, or leave "
                                      "--main_process_port out on one machine to get a free one") from None
                if exc.errno == errno.EADDRNOTAVAIL:  # that family has no address here
                    continue
                raise ConfigError(f"--main_process_port {port} cannot be used on this machine ({exc.strerror}); "
                                  "pick another port") from None
            return  # one family bound: torch's dual-stack listener can bind too
