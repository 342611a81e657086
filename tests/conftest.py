import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """Each in-process test starts as a plain single process with no launch config."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "IMPEL_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    from impel.runtime.process import ProcessState

    ProcessState._reset()
    yield
    ProcessState._reset()
