import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))



def _settings_variables():
    from impel.config.environment_settings import all_names, impel_name

    return {*all_names(), *(impel_name(n) for n in all_names())}


_SETTINGS = _settings_variables()


def _reset_accelerate_state():
    """Accelerate's process-wide state (its Accelerator's, or the mirror impel's Accelerator sets up when Accelerate
    is imported: impel.accelerator.accelerate_state) does not outlive a test, as in Accelerate's own suite."""
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """Each in-process test starts as a plain single process with no launch config."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "IMPEL_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    # Accelerate's settings variables (ACCELERATE_MIXED_PRECISION, FSDP_*, their IMPEL_* names) configure a run that
    # sees them: none leaks in from the caller's shell, and none a test (or an FSDP Accelerator) sets leaks out
    saved = [k for k in os.environ if k in _SETTINGS]
    for var in saved:
        monkeypatch.delenv(var)
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    _reset_accelerate_state()
    yield
    ProcessState._reset()
    _reset_accelerate_state()
    for var in [k for k in os.environ if k in _SETTINGS]:
        del os.environ[var]
