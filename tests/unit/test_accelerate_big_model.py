"""Accelerate's big-model pieces under impel's names (issue 38): PEFT imports ``accelerate.hooks``,
``dispatch_model``, ``infer_auto_device_map``, ``get_balanced_memory``, ``named_module_tensors``,
``offload_state_dict`` and ``utils.dataclasses.get_module_class_from_name``. They hold no distributed state, so under
impel's module paths they are Accelerate's own objects when Accelerate is installed (no second implementation), and
placeholders raising ``NotProvidedError`` with the reason when it is not."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytest.importorskip("accelerate")

from impel.config import unsupported  # noqa: E402
from impel.config.unsupported import ACCELERATES_OWN, NotProvidedError  # noqa: E402

# (PEFT's import, under impel's name) as PEFT 0.21 writes them (the finding's census)
PEFT_IMPORTS = [("accelerate", "dispatch_model"), ("accelerate", "infer_auto_device_map"),
                ("accelerate.hooks", "AlignDevicesHook"), ("accelerate.hooks", "add_hook_to_module"),
                ("accelerate.hooks", "remove_hook_from_module"), ("accelerate.hooks", "remove_hook_from_submodules"),
                ("accelerate.utils", "get_balanced_memory"), ("accelerate.utils", "named_module_tensors"),
                ("accelerate.utils", "offload_state_dict"),
                ("accelerate.utils.dataclasses", "get_module_class_from_name")]


def test_peft_imports_under_impels_names_are_accelerates_own_objects():
    for module, name in PEFT_IMPORTS:
        ours = getattr(importlib.import_module(module.replace("accelerate", "impel", 1)), name)
        assert ours is getattr(importlib.import_module(module), name), f"{module}.{name}"
    for face in ("impel", "impel.hooks", "impel.big_modeling", "impel.utils", "impel.utils.modeling"):
        mod = importlib.import_module(face)
        for name in set(mod.__all__) & ACCELERATES_OWN:
            assert getattr(mod, name).__module__.startswith("accelerate."), f"{face}.{name}"


def test_a_peft_model_dispatched_and_hooked_through_impels_names_runs_as_without_them(tmp_path):
    from peft import LoraConfig, get_peft_model

    from impel import dispatch_model, infer_auto_device_map
    from impel.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_submodules
    from impel.utils import get_balanced_memory, named_module_tensors, offload_state_dict
    from impel.utils.dataclasses import get_module_class_from_name
    from trl_helpers import tiny_gpt2

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    ids = torch.arange(2, 14).reshape(2, 6)
    expected = model(input_ids=ids).logits
    assert get_module_class_from_name(model, "GPT2Block").__name__ == "GPT2Block"
    memory = get_balanced_memory(model, max_memory={"cpu": 10**9})
    assert set(infer_auto_device_map(model, max_memory=memory).values()) == {"cpu"}
    assert len(dict(named_module_tensors(model, recurse=True))) == len(dict(model.named_parameters()))  # no buffers
    offload_state_dict(str(tmp_path), {"w": torch.ones(2)})
    assert (tmp_path / "index.json").exists()
    dispatched = dispatch_model(model, device_map={"": "cpu"})
    add_hook_to_module(dispatched.base_model.model.transformer.h[0], AlignDevicesHook(io_same_device=True))
    assert torch.equal(dispatched(input_ids=ids).logits, expected)
    remove_hook_from_submodules(dispatched)
    assert not hasattr(dispatched.base_model.model.transformer.h[0], "_hf_hook")


def test_without_accelerate_they_raise_naming_the_reason_and_the_install():
    with pytest.MonkeyPatch.context() as patch:  # undone before the fixtures read Accelerate's state again
        for module in [m for m in sys.modules if m == "accelerate" or m.startswith("accelerate.")]:
            patch.setitem(sys.modules, module, None)  # an import of it raises ImportError
        patch.setattr(unsupported, "_made", {})
        for name in ("dispatch_model", "AlignDevicesHook", "get_module_class_from_name"):
            value = unsupported.__getattr__(name)
            with pytest.raises(NotProvidedError, match=f"impel does not provide {name}: .*with Accelerate "
                                                       r"installed \(pip install 'accelerate>=1.15,<1.16'\)"):
                value()
