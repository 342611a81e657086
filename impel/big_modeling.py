"""``impel.big_modeling``: Accelerate's ``accelerate.big_modeling`` path for building models without weights and
loading weights into them (a face; they live in :mod:`impel.runtime.compat.model_loading`). Its inference side
(dispatch,
offloading) is not impel's: those names are Accelerate's own objects when Accelerate is installed, else they import
and raise ``NotProvidedError`` on use (:mod:`impel.config.unsupported`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {
    **{name: "impel.runtime.compat.model_loading" for name in (
        "init_empty_weights", "init_on_device", "load_checkpoint_in_model")},
    **{name: "impel.config.unsupported" for name in (
        "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model", "load_checkpoint_and_dispatch",
        "attach_layerwise_casting_hooks")},
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
