"""A rank's health as its peers and its launcher see it (issue 27): who waits for whom, and who left first.

**Stall watchdog.** A rank that stops making progress (stuck in its own code, stopped, a lost machine) leaves its
peers waiting in a collective with nothing printed until the process group's timeout (10 minutes by default).
Every rank marks where it enters impel's blocking calls (``backward``, whose gradient all-reduce runs inside it,
and the collectives) and a daemon thread publishes that, once a second, on the job's rendezvous store (its own
connection). A rank that has waited in one call for longer than ``IMPEL_STALL_WARNING`` seconds (``impel launch
--stall_warning``; 60 by default, 0: off) prints one line naming the call and the ranks it waits for, with what
each of them is doing, and again after each further such period. The process-group timeout still ends the job.
In an elastic job with restarts left, a waited-for rank whose heartbeat has not changed for another half period
(its machine frozen, e.g. SIGSTOP, or cut off: its connections stay open, so no collective fails) is declared lost:
the waiting rank says so in one line and exits, and its agent restarts the job on the machines that answer.

**Normal exit.** Under ``impel launch`` a rank that exits normally (its script ended or called ``sys.exit``)
notes the time in a folder the launcher gave it, so that a rank that left early is named as the cause when its
peers then fail (the launcher's last line), not the peers.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypedDict, TypeVar

from impel.config import environment as env

if TYPE_CHECKING:
    import torch.distributed as dist

P = ParamSpec("P")
R = TypeVar("R")
# one rank's heartbeat, as published on the store (JSON): the call it is in (None: outside impel's collectives),
# the last call's number and name, for how long (s), the wall time of the beat, and the script's line it waits in
Beat = TypedDict("Beat", {"in": str | None, "call": int, "what": str, "for": float, "wall": float,
                          "site": str | None}, total=False)


class HeartbeatStore(Protocol):
    """What the watchdog uses of a rendezvous store (``torch.distributed.Store``'s methods)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...

logger = logging.getLogger("impel")

_lock = threading.Lock()
_calls = 0  # impel blocking calls entered by this rank
_current: tuple[str, int, float] | None = None  # (what, call number, monotonic time entered) while inside one
_last: tuple[str, int, float] = ("start", 0, time.monotonic())  # the last call entered, for a rank outside any
_watchdog: Watchdog | None = None


watching = False  # a watchdog thread is running (2 or more ranks, the warning on): only then are calls marked


class blocking:  # noqa: N801 - used as a function: ``with blocking("gather"):`` / ``@blocking("gather")``
    """Mark a call that waits for the other ranks (cheap: a counter and a tuple; a plain class, not a generator,
    since ``backward`` enters one on every step while a watchdog runs)."""

    __slots__ = ("what", "outer")

    def __init__(self, what: str) -> None:
        self.what = what
        self.outer: tuple[str, int, float] | None = None

    def __enter__(self) -> None:
        global _calls, _current, _last
        with _lock:
            self.outer = _current  # a collective inside another (gather_for_metrics -> gather): the outer resumes
            _calls += 1
            _current = _last = (self.what, _calls, time.monotonic())

    def __exit__(self, *exc: object) -> None:
        global _current
        with _lock:
            _current = self.outer

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        what = self.what

        @functools.wraps(fn)
        def marked(*args: P.args, **kwargs: P.kwargs) -> R:
            with blocking(what):
                return fn(*args, **kwargs)

        return marked


def _snapshot() -> Beat:
    with _lock:
        current, last = _current, _last
    now = time.monotonic()
    return {"in": current[0] if current else None, "call": (current or last)[1], "what": (current or last)[0],
            "for": now - (current or last)[2], "wall": time.time()}


class Watchdog:
    """The heartbeat thread of one rank."""

    def __init__(self, store: HeartbeatStore, rank: int, world_size: int, stall_s: float, timeout_s: float,
                 lost_exits: bool = False) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stall_s, self.timeout_s = stall_s, timeout_s
        self.interval = min(1.0, max(stall_s / 4, 0.05))
        self.stop = threading.Event()
        self.next_warning = stall_s
        self.lost_exits = lost_exits  # an elastic job with restarts left: a lost peer ends this rank (restart)
        # peer -> (its last beat's stamp, when this rank saw it)
        self.unchanged: dict[int, tuple[float | None, float]] = {}
        self.exit: Callable[[int], object] = os._exit  # the main thread waits in a collective that never returns
        self.thread = threading.Thread(target=self._run, name="impel-watchdog", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the store is gone (the job is ending): stop quietly
                logger.debug("impel watchdog stopped: %s", exc)
                return

    def beat(self) -> None:
        mine = _snapshot()
        if mine["in"] is not None:
            mine["site"] = _call_site()
        self.store.set(f"hb/{self.rank}", json.dumps(mine))
        if mine["in"] is None:
            self.next_warning = self.stall_s
            self.unchanged.clear()
            return
        if self.lost_exits and mine["for"] >= self.stall_s / 2:
            self.exit_if_lost(mine)
        if mine["for"] < self.next_warning:
            return
        self.next_warning = mine["for"] + self.stall_s
        print(self.line(mine, self.peers()), file=sys.stderr, flush=True)

    def exit_if_lost(self, mine: Beat) -> None:
        """While this rank waits: a peer that beat before and whose beat has not changed for ``stall_s / 2`` (this
        rank's own clock: machines' clocks may differ) is lost; say so and exit, so the agent restarts the job."""
        now = time.monotonic()
        for r, beat in self.peers().items():
            stamp = None if beat is None else beat["wall"]
            seen = self.unchanged.get(r)
            if seen is None or seen[0] != stamp:
                self.unchanged[r] = (stamp, now)
            elif stamp is not None and now - seen[1] >= self.stall_s / 2:
                print(f"impel watchdog: rank {r} has sent no heartbeat for {now - seen[1]:.0f} s while rank "
                      f"{self.rank} waits for it in {mine['in']} #{mine['call']} (for {mine['for']:.0f} s): its "
                      f"machine is frozen, stopped or cut off; rank {self.rank} exits so that the elastic agent "
                      "restarts the job on the machines that answer, from the last checkpoint",
                      file=sys.stderr, flush=True)
                self.exit(1)

    def peers(self) -> dict[int, Beat | None]:
        out: dict[int, Beat | None] = {}
        for r in range(self.world_size):
            if r != self.rank:
                key = f"hb/{r}"
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def line(self, mine: Beat, peers: dict[int, Beat | None]) -> str:
        now = time.time()
        waited_for: list[str] = []
        for r, beat in sorted(peers.items()):
            if beat is None:
                waited_for.append(f"rank {r} (no heartbeat yet)")
            elif now - beat["wall"] > max(5 * self.interval, 3.0):
                waited_for.append(f"rank {r} (no heartbeat for {now - beat['wall']:.0f} s: frozen, stopped or its "
                                  "machine is gone)")
            elif beat["in"] is None:
                waited_for.append(f"rank {r} (outside impel's collectives for {beat['for']:.0f} s since "
                                  f"{beat['what']} #{beat['call']}: busy or stuck in the script's own code)")
            elif beat["in"] != mine["in"] and beat["call"] >= mine["call"]:
                waited_for.append(f"rank {r} (in {beat['in']} #{beat['call']} at {beat.get('site')}, while this rank "
                                  f"is in {mine['in']} at {mine.get('site')}: the two ranks are in different "
                                  "collectives, which never meet; every rank must call the same collectives in the "
                                  "same order)")
            elif beat["call"] < mine["call"]:
                waited_for.append(f"rank {r} (in {beat['in']} #{beat['call']}, behind)")
        head = f"impel watchdog: rank {self.rank} has waited {mine['for']:.0f} s in {mine['in']} #{mine['call']}"
        tail = (f"; the process-group timeout ({self.timeout_s:.0f} s) stops the job if nothing moves "
                f"({env.STALL_WARNING_VAR} / impel launch --stall_warning sets when this is printed)")
        if not waited_for:
            return head + " and so has every other rank (a collective that does not complete: network?)" + tail
        return head + " for " + ", ".join(waited_for) + tail


def _call_site() -> str | None:
    """``file:line`` of the script's code the main thread waits in: its innermost frame outside impel and torch
    (read by the watchdog thread once per beat, never on the step's path)."""
    import torch

    import impel

    skip = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (impel, torch, threading, functools))
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<"):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def start_watchdog(store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Start this rank's heartbeat thread (once per process group; nothing when the warning is off)."""
    global _watchdog, watching
    stall = env.stall_warning_seconds()
    if world_size < 2 or stall == 0 or store is None:
        return
    stop_watchdog()
    try:
        own = store.clone()  # its own connection: the thread never shares a socket with the main thread
    except Exception as exc:  # noqa: BLE001 - a store without clone (a custom one): no watchdog, said once
        logger.debug("no stall watchdog: the process group's store cannot be cloned (%s)", exc)
        return
    _watchdog = Watchdog(torch_prefix(own), rank, world_size, stall, timeout_s, lost_exits=_restart_heals())
    _watchdog.thread.start()
    watching = True


def _restart_heals() -> bool:
    """An elastic job (``impel launch --nnodes MIN:MAX``) with restarts left: its agent restarts the job without a
    lost machine."""
    launch = env.read_launch_config() or {}
    return launch.get("min_machines") is not None and env.restarts_left() > 0


def torch_prefix(store: dist.Store) -> dist.PrefixStore:
    import torch.distributed as dist

    return dist.PrefixStore("impel/watchdog", store)


def stop_watchdog() -> None:
    global _watchdog, watching
    watching = False
    if _watchdog is not None:
        _watchdog.stop.set()
        _watchdog.thread.join(2.0)
        _watchdog = None


def note_normal_exit(rank: int) -> None:
    """Under ``impel launch``: note that this rank is exiting normally now (read by the launcher on a failure)."""
    folder = env.rank_exit_dir()
    if folder is None:
        return
    try:
        Path(folder, f"rank{rank}").write_text(f"{time.time()}\n", encoding="utf-8")
    except OSError as exc:  # the launcher is gone, or its folder: nothing to tell
        logger.debug("could not note the exit of rank %d: %s", rank, exc)
