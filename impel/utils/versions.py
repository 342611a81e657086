"""``impel.utils.versions``: Accelerate's ``accelerate.utils.versions`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "STR_OPERATION_TO_FUNC", "compare_versions", "is_torch_version"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
