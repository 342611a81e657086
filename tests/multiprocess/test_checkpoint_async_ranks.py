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
