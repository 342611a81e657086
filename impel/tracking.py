"""``impel.tracking``: Accelerate's ``accelerate.tracking`` path (a face; trackers live in :mod:`impel.trackers`)."""
from __future__ import annotations

from impel.config.unsupported import TRACKERS
from impel.exports import lazy_face

_EXPORTS = {
    **{name: "impel.trackers.base" for name in ("GeneralTracker", "LoggerType", "on_main_process")},
    **{name: "impel.trackers.builtin" for name in (
        "JSONLTracker", "TensorBoardTracker", "WandBTracker", "MLflowTracker", "TrackioTracker")},
    **{name: "impel.trackers.registry" for name in (
        "get_available_trackers", "register_tracker_class", "LOGGER_TYPE_TO_CLASS")},
    **{name: "impel.config.unsupported" for name in TRACKERS},  # built-in trackers impel does not ship: why, on use
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
