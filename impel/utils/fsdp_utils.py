"""``impel.utils.fsdp_utils``: Accelerate's ``accelerate.utils.fsdp_utils`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "FSDP_MODEL_NAME", "OPTIMIZER_NAME", "SAFE_WEIGHTS_NAME", "WEIGHTS_NAME", "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading", "ensure_weights_retied", "fsdp2_apply_ac", "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict", "fsdp2_prepare_model", "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler", "get_module_children_bottom_up", "is_compiled_module", "is_peft_model",
    "is_torch_version", "load_fsdp_model", "load_fsdp_optimizer", "merge_fsdp_weights", "save", "save_fsdp_model",
    "save_fsdp_optimizer"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
