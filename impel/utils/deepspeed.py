"""``impel.utils.deepspeed``: Accelerate's ``accelerate.utils.deepspeed`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper", "DistributedType",
    "DummyOptim", "DummyScheduler", "HfDeepSpeedConfig", "compare_versions", "get_active_deepspeed_plugin",
    "is_bnb_available", "map_pytorch_optim_to_deepspeed"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
