"""The stall watchdog's bookkeeping and its line (impel.rank_health), without ranks: a dict stands for the store.
The end-to-end case (a real stall under impel launch) is tests/cli/test_launcher_processes.py's."""
from __future__ import annotations

import json
import time

import pytest

from impel.config import environment as env
from impel.runtime.ranks import rank_health


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def _beat(inside: str | None, call: int, what: str, since: float, age: float = 0.0) -> str:
    return json.dumps({"in": inside, "call": call, "what": what, "for": since, "wall": time.time() - age})


def test_nested_blocking_calls_restore_the_outer_one():
    with rank_health.blocking("gather_for_metrics"):
        with rank_health.blocking("gather"):
            assert rank_health._snapshot()["in"] == "gather"
        assert rank_health._snapshot()["in"] == "gather_for_metrics"
    assert rank_health._snapshot()["in"] is None


def test_the_line_names_the_rank_waited_for_and_what_it_does():
    store = DictStore()
    dog = rank_health.Watchdog(store, rank=0, world_size=4, stall_s=2.0, timeout_s=600)
    store.set("hb/1", _beat(None, 3, "backward", 5.0))
    store.set("hb/2", _beat("backward", 4, "backward", 5.0))  # with us: not waited for
    store.set("hb/3", _beat("backward", 3, "backward", 9.0, age=30.0))
    mine = {"in": "backward", "call": 4, "what": "backward", "for": 5.2, "wall": time.time()}
    line = dog.line(mine, dog.peers())
    assert line.startswith("impel watchdog: rank 0 has waited 5 s in backward #4 for rank 1 (outside impel's "
                           "collectives for 5 s since backward #3: busy or stuck in the script's own code), rank 3 "
                           "(no heartbeat for 30 s: frozen, stopped or its machine is gone)")
    assert "rank 2" not in line and "the process-group timeout (600 s) stops the job" in line


def test_a_beat_warns_once_per_stall_period(capsys):
    store = DictStore()
    dog = rank_health.Watchdog(store, rank=1, world_size=2, stall_s=0.2, timeout_s=60)
    store.set("hb/0", _beat(None, 1, "backward", 1.0))
    with rank_health.blocking("wait_for_everyone"):
        dog.beat()
        assert capsys.readouterr().err == ""  # not stalled yet
        time.sleep(0.25)
        dog.beat()
        dog.beat()
        err = capsys.readouterr().err
    assert err.count("impel watchdog: rank 1 has waited") == 1 and "for rank 0 (outside" in err
    assert json.loads(store.get("hb/1"))["in"] == "wait_for_everyone"


def test_the_stall_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(env.STALL_WARNING_VAR, raising=False)
    assert env.stall_warning_seconds() == 60.0
    monkeypatch.setenv(env.STALL_WARNING_VAR, "0")
    assert env.stall_warning_seconds() == 0.0
    monkeypatch.setenv(env.STALL_WARNING_VAR, "soon")
    with pytest.raises(ValueError, match="IMPEL_STALL_WARNING='soon' is not a number of seconds >= 0"):
        env.stall_warning_seconds()


def test_an_elastic_rank_exits_once_a_peer_it_waits_for_stops_beating(capsys, monkeypatch):
    """A frozen machine keeps its connections: no collective fails, so the rank waiting for it exits (its agent
    then restarts the job without it). A peer that beats (busy, not frozen) or never beat (its watchdog off) is
    not lost."""
    store, clock, exits = DictStore(), [100.0], []
    monkeypatch.setattr(rank_health.time, "monotonic", lambda: clock[0])
    dog = rank_health.Watchdog(store, rank=0, world_size=4, stall_s=4.0, timeout_s=600, lost_exits=True)
    dog.exit = exits.append
    mine = {"in": "backward", "call": 7, "what": "backward", "for": 2.0}
    store.set("hb/1", _beat(None, 6, "backward", 1.0))  # frozen from now on
    for second in range(2):  # lost once unchanged for stall_s / 2
        store.set("hb/2", _beat(None, 6, "backward", 1.0 + second))  # busy in its own code, beating
        dog.exit_if_lost({**mine, "for": 2.0 + second})
        assert exits == [], capsys.readouterr().err
        clock[0] += 1.0
    store.set("hb/2", _beat(None, 6, "backward", 9.0))
    dog.exit_if_lost({**mine, "for": 4.0})
    assert exits == [1]
    assert capsys.readouterr().err.strip() == (
        "impel watchdog: rank 1 has sent no heartbeat for 2 s while rank 0 waits for it in backward #7 (for 4 s): its "
        "machine is frozen, stopped or cut off; rank 0 exits so that the elastic agent restarts the job on the "
        "machines that answer, from the last checkpoint")


def test_only_an_elastic_job_with_restarts_left_exits_for_a_lost_peer(monkeypatch):
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"min_machines": 1, "num_machines": 2}))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert rank_health._restart_heals()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # no restart left: the group timeout ends the job
    assert not rank_health._restart_heals()
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"num_machines": 2}))  # fixed machines: a restart waits for it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not rank_health._restart_heals()
