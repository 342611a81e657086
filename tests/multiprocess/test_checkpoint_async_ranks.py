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
    from impel.checkpoint import CheckpointError

    acc = Accelerator(project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True))
    model = torch.nn.Linear(4, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    obj = _Unstorable()
    acc.register_for_checkpointing(obj)
    out: dict = {}
    try:
        out["returned"] = acc.save_state(async_save=True)  # no collective after staging: rank 1 returns
    except CheckpointError as exc:
        out["raised_at_call"] = str(exc)
    try:
        out["waited"] = acc.wait_for_checkpoint()
    except CheckpointError as exc:
        out["raised_at_wait"] = str(exc)
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
