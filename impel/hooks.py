"""``impel.hooks``: Accelerate's ``accelerate.hooks`` path. Its hooks serve big-model inference (device maps,
offloading), which impel does not implement; they hold no distributed state, so with Accelerate installed every name
is Accelerate's own object (PEFT uses them), and without it using one raises ``NotProvidedError`` with the reason
(:mod:`impel.config.unsupported`). The training path needs none of them."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {name: "impel.config.unsupported" for name in (
    "ModelHook", "SequentialHook", "AlignDevicesHook", "CpuOffload", "UserCpuOffloadHook", "LayerwiseCastingHook",
    "add_hook_to_module", "remove_hook_from_module", "remove_hook_from_submodules", "attach_align_device_hook",
    "attach_align_device_hook_on_blocks", "attach_execution_device_hook", "attach_layerwise_casting_hooks")}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
