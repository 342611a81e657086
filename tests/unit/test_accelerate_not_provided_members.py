"""Accelerate 1.15's Accelerator members and arguments that impel deliberately does not provide raise
``NotProvidedError`` naming the member, the reason and the alternative (never a bare AttributeError / TypeError);
the ones impel maps onto its own settings take effect (``torch_tp_plugin``: a ParallelismConfig, with Accelerate's
FutureWarning)."""
from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")

from impel import Accelerator, DeepSpeedPlugin  # noqa: E402
from impel.config.parallelism import ParallelismConfig  # noqa: E402
from impel.config.unsupported import NotProvidedError  # noqa: E402
from impel.state import AcceleratorState  # noqa: E402
from impel.utils import TorchTensorParallelPlugin  # noqa: E402

MEMBERS = ["fp8_backend", "fp8_recipe_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler",
           "delayed_fp8_autocast", "lomo_backward", "deepspeed_engine_wrapped", "deepspeed_config",
           "deepspeed_ulysses_dl_adapter"]


def test_every_accelerate_accelerator_member_resolves_or_raises_not_provided():
    # Accelerate's public members and the attributes its Accelerator sets: none may be a bare AttributeError
    import inspect
    import re

    source = inspect.getsource(accelerate.Accelerator)
    names = {n for n in dir(accelerate.Accelerator) if not n.startswith("_")}
    names |= set(re.findall(r"self\.([a-z][a-z0-9_]*)\s*=", source))
    acc = Accelerator(cpu=True)
    bare = []
    for name in sorted(names):
        try:
            getattr(acc, name)
        except NotProvidedError as error:
            assert f"Accelerator.{name}: " in str(error)
        except AttributeError:
            bare.append(name)
        except Exception:  # noqa: BLE001 (a member that needs a prepared object or DeepSpeed: it exists)
            pass
    assert bare == []


METHODS = {"lomo_backward", "deepspeed_ulysses_dl_adapter"}  # methods in Accelerate: they raise when called


@pytest.mark.parametrize("name", MEMBERS)
def test_fp8_lomo_and_deepspeed_internal_members_raise_not_provided(name):
    acc = Accelerator(cpu=True)
    with pytest.raises(NotProvidedError, match=f"impel does not provide Accelerator.{name}: .*(use|read|train|raises|"
                                                "prepared model)"):
        getattr(acc, name)(None, None) if name in METHODS else getattr(acc, name)
    assert hasattr(Accelerator, name)  # the class shows Accelerate's name


def test_members_raise_on_use_not_on_introspection():
    """Introspection never raises: help(), inspect, mock autospec and completion see the members; an attribute
    reads as absent (an AttributeError: hasattr is False), a method is a function that raises when called."""
    import inspect
    import pydoc
    from unittest import mock

    from impel.accelerator.not_provided import NotProvidedMember, NotProvidedMembers

    members = sorted(n for n, v in vars(NotProvidedMembers).items() if isinstance(v, NotProvidedMember))
    assert members == sorted(MEMBERS)
    acc = Accelerator(cpu=True)
    text = pydoc.render_doc(acc, renderer=pydoc.plaintext)  # help(accelerator)
    assert all(n in text for n in members) and set(members) <= set(dir(acc))
    spec = mock.create_autospec(Accelerator, instance=True)
    for name in members:
        assert hasattr(spec, name)
        if name in METHODS:
            inspect.signature(getattr(acc, name))
            assert getattr(acc, name).__doc__.startswith("Not provided by impel: ")
        else:
            assert not hasattr(acc, name) and getattr(acc, name, "absent") == "absent"


def test_flags_answer_as_accelerate_without_fp8_or_lomo():
    mine, theirs = Accelerator(cpu=True), accelerate.Accelerator(cpu=True)
    try:
        for name in ("has_fp8_handler", "has_lomo_optimizer"):
            assert getattr(mine, name) is getattr(theirs, name) is False
    finally:
        accelerate.state.AcceleratorState._reset_state(True)


def test_megatron_raises_not_provided_and_deepspeed_plugins_are_checked():
    with pytest.raises(NotProvidedError, match="megatron_lm_plugin.*does not drive Megatron-LM.*FSDP"):
        Accelerator(cpu=True, megatron_lm_plugin=object())
    with pytest.raises(ValueError, match="either deepspeed_plugin or deepspeed_plugins"):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(), deepspeed_plugins={"a": DeepSpeedPlugin()})
    with pytest.raises(TypeError, match="'a' is not a DeepSpeedPlugin"):
        Accelerator(cpu=True, deepspeed_plugins={"a": object()})


def test_deepspeed_plugin_lookups_without_deepspeed_raise_as_accelerate():
    acc = Accelerator(cpu=True)
    assert AcceleratorState().deepspeed_plugins is None and acc.state.deepspeed_plugin is None
    for method in ("get_deepspeed_plugin", "select_deepspeed_plugin"):
        with pytest.raises(ValueError, match="DeepSpeed is not enabled"):
            getattr(AcceleratorState(), method)("student")


def test_torch_tp_plugin_is_parallelism_config_tp_size_with_accelerates_warning():
    with pytest.warns(FutureWarning, match="deprecated.*ParallelismConfig\\(tp_size=1\\)"):
        acc = Accelerator(cpu=True, torch_tp_plugin=TorchTensorParallelPlugin(tp_size=1))
    assert acc.parallelism_config.tp_size == 1
    with pytest.raises(Exception, match="either torch_tp_plugin or parallelism_config"):
        Accelerator(cpu=True, torch_tp_plugin=TorchTensorParallelPlugin(), parallelism_config=ParallelismConfig())
    with pytest.raises(Exception, match="tp_size=0"):
        TorchTensorParallelPlugin(tp_size=0)
    fields = accelerate.utils.TorchTensorParallelPlugin()
    assert (fields.tp_size, fields.torch_device_mesh) == (TorchTensorParallelPlugin().tp_size, None)
