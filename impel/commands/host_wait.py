"""A machine other than machine 0 waits for machine 0 before torchrun's agent starts (issue 36, E12).

Machine 0 hosts the rendezvous (its store listens on ``--main_process_ip:--main_process_port``). Without it,
torchrun's agent on another machine retries for about two minutes in silence, then prints C++ stack frames. Here
the launcher probes the address first: it says at once that machine 0 does not answer, says again every
:data:`EVERY` seconds, and after the rendezvous's ``join_timeout`` (600 s, torch's default, or ``--rdzv_conf
join_timeout=N``) ends with one line naming the address and the fix. A probe is a plain TCP connect, closed at once:
the store on machine 0 takes it as a client that left.
"""
from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable

EVERY = 30.0  # seconds between two "still waiting" lines
DEFAULT_JOIN_TIMEOUT = 600.0  # torch's c10d rendezvous join_timeout


def join_timeout(agent_args: list[str]) -> float:
    """``join_timeout`` of ``--rdzv_conf`` (validated as KEY=VALUE pairs by the plan), else torch's default."""
    if "--rdzv_conf" not in agent_args:
        return DEFAULT_JOIN_TIMEOUT
    for pair in agent_args[agent_args.index("--rdzv_conf") + 1].split(","):
        key, _, value = pair.partition("=")
        if key.strip() == "join_timeout":
            try:
                return max(float(value), 1.0)
            except ValueError:
                return DEFAULT_JOIN_TIMEOUT  # torch refuses it with its own error once the agent starts
    return DEFAULT_JOIN_TIMEOUT


def wait_for_machine_0(host: str, port: int, limit_s: float, say: Callable[[str], None] | None = None,
                       clock: Callable[[], float] = time.monotonic) -> bool:
    """True once ``host:port`` accepts a connection; False (after one line) when ``limit_s`` passed without."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    start = clock()
    said_at: float | None = None
    while True:
        waited = clock() - start
        try:
            with socket.create_connection((host, port), timeout=max(0.5, min(5.0, limit_s - waited))):
                if said_at is not None:
                    say(f"impel launch: machine 0 answered at {host}:{port} after {waited:.0f} s; joining")
                return True
        except OSError as exc:
            error = exc.strerror or type(exc).__name__
        waited = clock() - start
        if waited >= limit_s:
            say(f"impel launch: machine 0 never answered at {host}:{port} in {limit_s:.0f} s ({error}); it hosts "
                "the rendezvous: start machine 0 (--machine_rank 0) with the same --main_process_ip and "
                "--main_process_port, check that this machine reaches that address (firewall, a wrong IP), then "
                "start this machine again (--rdzv_conf join_timeout=N waits longer)")
            return False
        if said_at is None or waited - said_at >= EVERY:
            state = "does not answer" if said_at is None else "still does not answer"
            say(f"impel launch: machine 0 (the rendezvous host, {host}:{port}) {state} ({error}) after "
                f"{waited:.0f} s; waiting up to {limit_s:.0f} s (--rdzv_conf join_timeout) for it to start")
            said_at = waited
        time.sleep(min(1.0, max(0.0, limit_s - waited)))
