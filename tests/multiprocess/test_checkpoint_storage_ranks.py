"""A full disk met by one rank of two during a synchronous save_state: that rank raises the one-line OSError naming
the directory, the other rank raises with that line inside, and the previous checkpoint is kept and loads."""
from __future__ import annotations

import pytest

from impel.testing import run_on_ranks
from storage_helpers import full_disk_on_one_rank

TIMEOUT = 120
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(TIMEOUT + 60)]


def test_a_full_disk_on_rank_1_fails_the_save_on_both_ranks_and_keeps_the_previous_checkpoint(tmp_path):
    results = run_on_ranks(full_disk_on_one_rank, 2, args=(str(tmp_path), 1), timeout=TIMEOUT)
    line = f"OSError: [Errno 28] no space left on {tmp_path / 'ckpt'}: the checkpoint needs "
    assert results[1]["error"].startswith(line), results[1]["error"]
    assert results[0]["error"].startswith(f"CheckpointError: save_state failed on another rank (rank 1: {line}"), \
        results[0]["error"]
    for out in results:
        assert out["listing"] == ["ckpt"] and out["same"], out  # no temporary directory; the first save loads
