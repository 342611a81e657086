"""save_state(async_save=True) on 2 ranks, DDP and FSDP SHARDED_STATE_DICT (DCP): the checkpoint holds the state at
the call although training went on before it was committed, every file equals the synchronous save's and loads
into the same state; under DDP a background failure on rank 1 raises at the next save_state on both ranks."""
from __future__ import annotations

import json

import pytest

from async_checkpoint_helpers import assert_same_state, async_equals_sync
from impel.testing import run_on_ranks

TIMEOUT = 120
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(TIMEOUT + 60)]
FSDP = {"distributed_type": "FSDP", "use_cpu": True,
        "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}


@pytest.mark.parametrize("kind", ["DDP", "FSDP"])
def test_async_save_on_two_ranks_is_the_call_time_state(kind, tmp_path):
    env = {"IMPEL_CONFIG": json.dumps(FSDP)} if kind == "FSDP" else {}
    fail_on = 1 if kind == "DDP" else None
    results = run_on_ranks(async_equals_sync, 2, args=(str(tmp_path), fail_on), timeout=TIMEOUT, env=env)
    for rank, out in enumerate(results):
        assert out["returned"] == out["waited"] == str(tmp_path / "async")
        assert out["committed_early"] is False and out["again"] is None
        sync, asynchronous = out["manifests"]
        assert sync == asynchronous, rank  # DCP shards too: each rank's bytes identical
        assert any(name.endswith(".distcp") for name in sync) == (kind == "FSDP")
        assert_same_state(*out["loaded"])
        if fail_on is None:
            continue
        cause = f"OSError: [Errno 28] no space left on {tmp_path / 'failed'}: the checkpoint needs "
        where = cause if rank == fail_on else f"CheckpointError: save_state failed on another rank (rank 1: {cause}"
        assert out["error"].startswith(f"the asynchronous save_state() to {tmp_path / 'failed'} failed: {where}")
        assert "failed" not in out["failed_listing"]  # never committed; the leader deletes its temporary directory:
        assert rank == 1 or out["failed_listing"] == ["async", "sync"]
        assert out["retry"] == str(tmp_path / "next")


def _try(out: dict, ok: str, failed: str, call) -> None:
    """``out[ok]`` = what ``call()`` returned, or ``out[failed]`` = the CheckpointError it raised (as a string)."""
    from impel.checkpoint import CheckpointError

    try:
        out[ok] = call()
    except CheckpointError as exc:
        out[failed] = str(exc)


class _Unstorable:
    """A registered object whose state cannot be stored until fixed (the leader stages it: staging fails on rank 0
    only)."""

    def __init__(self) -> None:
        self.broken = True

    def state_dict(self) -> dict:
        import threading

        return {"lock": threading.Lock()} if self.broken else {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


def _staging_fails_on_one_rank(root: str) -> dict:
    import os

    import torch

    from impel import Accelerator, ProjectConfiguration

    acc = Accelerator(project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True))
    model = torch.nn.Linear(4, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    obj = _Unstorable()
    acc.register_for_checkpointing(obj)
    out: dict = {}
    # no collective after staging: rank 1 returns
    _try(out, "returned", "raised_at_call", lambda: acc.save_state(async_save=True))
    _try(out, "waited", "raised_at_wait", acc.wait_for_checkpoint)
    out["iteration"] = acc.project_configuration.iteration
    obj.broken = False  # fixed: the next save works on every rank
    out["next"] = acc.save_state(async_save=True)
    acc.wait_for_checkpoint()
    out["listing"] = sorted(os.listdir(os.path.join(root, "checkpoints")))
    acc.end_training()
    return out


def test_a_staging_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    results = run_on_ranks(_staging_fails_on_one_rank, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    first, second = results
    assert "cannot save registered object 0" in first["raised_at_call"]  # where it happened: at the call
    assert "raised_at_wait" not in first and first["waited"] is None  # raised once
    assert "returned" in second and "save_state failed on another rank (rank 0: CheckpointError: cannot save" in \
        second["raised_at_wait"]  # elsewhere: when the save is waited for
    assert first["iteration"] == second["iteration"] == 1  # the ranks still agree on the next name
    assert first["next"] == second["next"] and first["listing"] == second["listing"] == ["checkpoint_1"]


def _ranks_call_one_after_the_other(root: str) -> dict:
    """Rank 1 calls save_state(async_save=True) only once rank 0's call has returned (a marker file): the call itself
    must not wait for the other ranks (the check-in runs on the background thread)."""
    import os
    import time
    from datetime import timedelta

    from checkpoint_helpers import make_run, train

    acc, model, opt, loader, sched = make_run(None)
    acc.state.timeout = timedelta(seconds=20)  # the old call's check-in: rank 0 would raise after 20 s
    acc.save_state(os.path.join(root, "first"), async_save=True)  # creates the background group (collective)
    acc.wait_for_checkpoint()
    train(acc, model, opt, loader, sched, until=2)
    marker = os.path.join(root, "rank0-returned")
    out: dict = {}
    if acc.process_index == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        out["saw_marker"] = os.path.exists(marker)
    _try(out, "returned", "raised", lambda: acc.save_state(os.path.join(root, "second"), async_save=True))
    if acc.process_index == 0:
        open(marker, "w").close()
    out["waited"] = acc.wait_for_checkpoint()
    out["listing"] = sorted(n for n in os.listdir(root) if not n.startswith("rank0"))
    train(acc, model, opt, loader, sched, until=4)
    acc.load_state(os.path.join(root, "second"))
    out["steps"] = opt.steps_taken  # the state at the call
    acc.end_training()
    return out


def test_an_async_save_call_does_not_wait_for_the_other_ranks(tmp_path):
    results = run_on_ranks(_ranks_call_one_after_the_other, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    for rank, out in enumerate(results):
        assert "raised" not in out, out.get("raised")
        assert out["returned"] == out["waited"] == str(tmp_path / "second"), rank
        assert out["listing"] == ["first", "second"]  # committed; no temporary directory left
        assert out["steps"] == 2
    assert results[1]["saw_marker"]


def _async_save_on_rank_zero_only(root: str) -> dict:
    import os
    from datetime import timedelta

    from checkpoint_helpers import make_run

    acc, model, opt, loader, sched = make_run(None)
    acc.state.timeout = timedelta(seconds=5)  # the background group's timeout, set when the first save creates it
    acc.save_state(os.path.join(root, "both"), async_save=True)
    acc.wait_for_checkpoint()
    acc.wait_for_everyone()
    out: dict = {}
    if acc.is_main_process:
        out["returned"] = acc.save_state(os.path.join(root, "alone"), async_save=True)  # staged: returns
        _try(out, "waited", "error", acc.wait_for_checkpoint)
    acc.wait_for_everyone()
    out["listing"] = sorted(os.listdir(root))
    acc.wait_for_everyone()  # both have listed before either starts the next save (its directory)
    # the background group timed out on rank 0 (gloo closes its connections then): the next asynchronous save
    # fails on both ranks, named, instead of hanging; a synchronous save (the default group) still works
    acc.save_state(os.path.join(root, "again"), async_save=True)
    _try(out, "waited_again", "again", acc.wait_for_checkpoint)
    out["sync"] = acc.save_state(os.path.join(root, "sync"))
    acc.wait_for_everyone()
    out["listing_again"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    acc.end_training()
    return out


def test_an_async_save_called_on_one_rank_only_fails_instead_of_hanging(tmp_path):
    main, other = run_on_ranks(_async_save_on_rank_zero_only, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    assert main["returned"] == str(tmp_path / "alone")
    assert main["error"].startswith(f"the asynchronous save_state() to {tmp_path / 'alone'} failed: CheckpointError: "
                                    f"not every rank joined the asynchronous save_state() to {tmp_path / 'alone'} "
                                    "within 0:00:05; save_state() is collective: call it on every rank"), main["error"]
    assert main["listing"] == other["listing"] == ["both"]  # nothing committed, the temporary directory removed
    for out in (main, other):
        assert out["again"].startswith(f"the asynchronous save_state() to {tmp_path / 'again'} failed: "
                                       "CheckpointError: "), out["again"]
        assert out["sync"] == str(tmp_path / "sync") and out["listing_again"] == ["both", "sync"]


def _first_async_save_on_rank_zero_only(root: str) -> str | None:
    import os
    from datetime import timedelta

    from checkpoint_helpers import make_run

    acc, *_ = make_run(None)
    if not acc.is_main_process:
        return None
    acc.state.timeout = timedelta(seconds=2)
    try:  # the first asynchronous save creates the background group (collective): it checks in first
        acc.save_state(os.path.join(root, "alone"), async_save=True)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def test_a_first_async_save_on_one_rank_only_raises_at_the_call(tmp_path):
    message, _ = run_on_ranks(_first_async_save_on_rank_zero_only, 2, args=(str(tmp_path),), timeout=90)
    assert message.startswith("CheckpointError") and "rank(s) [1] did not call it within 0:00:02" in message


def _target_check_fails_on_rank_one(root: str) -> dict:
    import os
    from datetime import timedelta

    from checkpoint_helpers import make_run
    from impel.checkpoint import CheckpointError
    from impel.checkpoint.store import target

    acc, *_ = make_run(None)
    acc.state.timeout = timedelta(seconds=60)  # rank 0 must learn of rank 1's failure long before this
    acc.save_state(os.path.join(root, "first"), async_save=True)
    acc.wait_for_checkpoint()
    real = target.prepare
    if acc.process_index == 1:  # a check that fails on one rank only (a filesystem that rank sees differently)
        def failing(*args, **kwargs):
            raise CheckpointError("injected: this rank may not write there")
        target.prepare = failing
    out: dict = {}
    _try(out, "returned", "raised_at_call", lambda: acc.save_state(os.path.join(root, "bad"), async_save=True))
    target.prepare = real
    _try(out, "waited", "raised_at_wait", acc.wait_for_checkpoint)
    out["next"] = acc.save_state(os.path.join(root, "next"), async_save=True)  # the ranks still agree
    acc.wait_for_checkpoint()
    acc.wait_for_everyone()
    out["listing"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    acc.end_training()
    return out


def test_a_target_check_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    main, other = run_on_ranks(_target_check_fails_on_rank_one, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    assert other["raised_at_call"] == "injected: this rank may not write there" and other["waited"] is None
    assert main["returned"] == str(tmp_path / "bad")
    assert "save_state failed on another rank (rank 1: CheckpointError: injected" in main["raised_at_wait"]
    assert main["next"] == other["next"] == str(tmp_path / "next")
    assert main["listing"] == other["listing"] == ["first", "next"]
