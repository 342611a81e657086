"""Accelerate's module tree under impel's name: every public name of Accelerate's ``utils`` submodules,
``data_loader``, ``state``, ``hooks``, ``big_modeling`` and ``commands.config``, and every name the installed
transformers imports from Accelerate, resolves under ``impel``; names impel deliberately does not provide import and
raise ``NotProvidedError`` (a ``NotImplementedError``) naming themselves and the reason on use.

The reference lists are read from the installed Accelerate and transformers at test time, so a new name in either
shows up here."""
from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

accelerate_utils = pytest.importorskip("accelerate.utils")

from impel.config.unsupported import REASONS, NotProvidedError  # noqa: E402

UTILS_SUBMODULES = ["dataclasses", "operations", "memory", "random", "modeling", "imports", "other", "constants",
                    "deepspeed", "environment", "fsdp_utils", "launch", "versions"]

# Accelerate names deliberately absent under impel's paths (not in accelerate.utils' namespace: internals).
INTERNAL = {
    "TYPE_CHECKING", "BETA_CP_AVAILABLE_PYTORCH_VERSION", "BETA_TP_AVAILABLE_PYTORCH_VERSION",
    "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION", "BETA_SP_AVAILABLE_DEEPSPEED_VERSION", "DTENSOR_PYTORCH_VERSION",
    "MODEL_CONFIGS_TO_MEGATRON_PARSERS", "TENSOR_INT_TO_DTYPE", "TENSOR_TYPE_TO_INT", "USE_TORCH_XLA",
    "TORCH_SAFE_GLOBALS", "SAGEMAKER_PARALLEL_EC2_INSTANCES", "SAGEMAKER_PYTHON_VERSION",
    "SAGEMAKER_PYTORCH_VERSION", "SAGEMAKER_TRANSFORMERS_VERSION", "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
}


def _public(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = []
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or inspect.ismodule(value):
            continue
        if name in dir(accelerate_utils) or name.isupper():  # accelerate.utils' namespace: the documented names
            names.append(name)
    return names


def _cases() -> list[tuple[str, str]]:
    cases = [(f"utils.{sub}", name) for sub in UTILS_SUBMODULES for name in _public(f"accelerate.utils.{sub}")]
    for path in ("data_loader", "state", "hooks", "big_modeling"):
        module = importlib.import_module(f"accelerate.{path}")
        cases += [(path, name) for name in dir(module)
                  if getattr(getattr(module, name), "__module__", None) == f"accelerate.{path}"
                  and not name.startswith("_")]
    return [c for c in cases if c[1] not in INTERNAL]


# Accelerate internals of those modules that public code does not use (listed in the compatibility page).
NOT_FACED = {("data_loader", "DataLoaderAdapter"), ("data_loader", "DataLoaderStateMixin"),
             ("data_loader", "get_sampler"), ("state", "ThreadLocalSharedDict"), ("state", "do_nothing")}


def test_every_accelerate_name_resolves_under_impel():
    cases = [c for c in _cases() if c not in NOT_FACED]
    assert len(cases) > 350
    missing = []
    for path, name in cases:
        module = importlib.import_module(f"impel.{path}")
        try:
            getattr(module, name)
        except AttributeError as error:
            missing.append(f"{path}.{name}: {error}")
    assert not missing


def _transformers_imports() -> set[tuple[str, str]]:
    transformers = pytest.importorskip("transformers")
    root = pathlib.Path(transformers.__file__).parent
    found = set()
    for file in root.rglob("*.py"):
        text = file.read_text(encoding="utf-8")
        if "from accelerate" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "accelerate":
                found |= {(node.module, alias.name) for alias in node.names}
    return found


def test_every_name_transformers_imports_from_accelerate_resolves_under_impel():
    pairs = _transformers_imports()
    assert len(pairs) >= 40  # transformers 5.x imports 45 names from 13 Accelerate modules
    missing = []
    for module, name in sorted(pairs):
        try:
            getattr(importlib.import_module(module.replace("accelerate", "impel", 1)), name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{module}.{name}: {error}")
    assert not missing


@pytest.mark.parametrize("module,name", [("impel.utils", "FP8RecipeKwargs"), ("impel.utils", "MegatronLMPlugin"),
                                         ("impel.utils", "BnbQuantizationConfig"),
                                         ("impel.utils.deepspeed", "HfDeepSpeedConfig")])
def test_a_name_impel_does_not_provide_imports_and_raises_with_its_reason_on_use(module, name):
    value = getattr(importlib.import_module(module), name)
    with pytest.raises(NotProvidedError, match=f"impel does not provide {name}: .*; "):
        value()
    with pytest.raises(NotImplementedError, match=name):
        value.some_attribute  # noqa: B018
    assert isinstance(object(), value) is False  # still a type: isinstance checks keep working
    assert REASONS[name] in (value.__doc__ or "")


@pytest.mark.parametrize("name", ["Accelerator", "DataLoaderConfiguration", "GradientAccumulationPlugin",
                                  "DistributedDataParallelKwargs", "FullyShardedDataParallelPlugin", "DeepSpeedPlugin",
                                  "DistributedType", "AcceleratorState", "GradientState", "AcceleratedOptimizer",
                                  "AcceleratedScheduler", "ProjectConfiguration", "ParallelismConfig"])
def test_names_scripts_import_from_the_accelerator_module_resolve(name):
    accelerator_module = importlib.import_module("accelerate.accelerator")
    mine = getattr(importlib.import_module("impel.accelerator"), name)
    assert mine.__name__ == getattr(accelerator_module, name).__name__


def test_unknown_names_stay_attribute_errors():
    import impel.utils.operations as ops

    with pytest.raises(AttributeError, match="no_such_name"):
        ops.no_such_name  # noqa: B018


def test_commands_config_loaders(tmp_path):
    from impel.commands.config import default_config_file, load_config_from_file

    assert default_config_file.endswith("default_config.yaml")
    path = tmp_path / "cfg.yaml"
    path.write_text("mixed_precision: bf16\nnum_processes: 2\n", encoding="utf-8")
    loaded = load_config_from_file(str(path))
    assert loaded.to_dict()["mixed_precision"] == "bf16" and loaded.num_processes == 2
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config_from_file(str(tmp_path / "missing.yaml"))


# --- every top-level module path of the installed Accelerate ------------------------------------------------------
# the one path impel does not provide (importing it raises ImportError naming the reason)
NO_MODULE = {"test_utils": "Accelerate's own test-suite helpers"}
# names defined in those modules that impel leaves out (internals; listed in the compatibility page)
TOP_INTERNAL = NOT_FACED | {("launchers", "test_launch"), ("tracking", "filter_trackers")}


def _accelerate_module_paths() -> list[str]:
    import pkgutil

    return sorted(m.name for m in pkgutil.iter_modules(importlib.import_module("accelerate").__path__))


def test_every_accelerate_module_path_imports_under_impel_or_names_its_reason():
    import warnings

    paths = _accelerate_module_paths()
    assert len(paths) >= 18 and {"optimizer", "scheduler", "checkpointing", "memory_utils", "inference"} <= set(paths)
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "accelerate-compatibility.md").read_text()
    missing = []
    for path in paths:
        assert f"`accelerate.{path}`" in page, f"docs/accelerate-compatibility.md does not list accelerate.{path}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # memory_utils warns, as Accelerate's does
            theirs = importlib.import_module(f"accelerate.{path}")
            if path in NO_MODULE:
                with pytest.raises(ImportError, match=f"impel.{path} is not provided: .*{NO_MODULE[path]}.*; "):
                    importlib.import_module(f"impel.{path}")
                continue
            mine = importlib.import_module(f"impel.{path}")
        names = [n for n in dir(theirs) if not n.startswith("_")
                 and getattr(getattr(theirs, n), "__module__", None) == f"accelerate.{path}"]
        missing += [f"impel.{path}.{n}" for n in names if (path, n) not in TOP_INTERNAL and not hasattr(mine, n)]
    assert not missing


def test_moved_paths_are_the_same_objects_and_memory_utils_warns_as_accelerate():
    import sys

    from impel.runtime.ranks.collectives import send_to_device
    from impel.runtime.step.optimizer import AcceleratedOptimizer, AcceleratedScheduler

    assert importlib.import_module("impel.optimizer").AcceleratedOptimizer is AcceleratedOptimizer
    assert importlib.import_module("impel.optimizer").move_to_device is send_to_device
    assert importlib.import_module("impel.scheduler").AcceleratedScheduler is AcceleratedScheduler
    sys.modules.pop("impel.memory_utils", None)
    with pytest.warns(FutureWarning, match="memory_utils has been reorganized to utils.memory"):
        importlib.import_module("impel.memory_utils")


def _placeholders():
    import impel.config.unsupported as unsupported

    # the big-model names are Accelerate's own objects where it is installed (tests/unit/test_accelerate_big_model.py)
    return [getattr(unsupported, name) for name in sorted(set(REASONS) - unsupported.ACCELERATES_OWN)]


def test_placeholders_raise_on_use_not_on_introspection():
    """Every name impel does not provide: inspect.signature, help(), dir, mock autospec and completion work; an
    attribute it lacks is an AttributeError (hasattr False) naming the reason; building or calling it raises."""
    import pydoc
    import rlcompleter
    from unittest import mock

    from impel.config.unsupported import NotProvidedAttributeError

    placeholders = _placeholders()
    assert len(placeholders) >= 70
    for value in placeholders:
        name = value.__name__
        inspect.signature(value)
        assert REASONS[name] in pydoc.render_doc(value, renderer=pydoc.plaintext)
        dir(value)
        spec = mock.create_autospec(value)
        spec(1, key=2)  # the autospec mock is callable as the name is
        completer = rlcompleter.Completer({"x": value})
        completer.complete("x.", 0)
        assert not hasattr(value, "some_attribute") and getattr(value, "from_pretrained", None) is None
        with pytest.raises(NotProvidedAttributeError, match=f"impel does not provide {name} "):
            value.some_attribute  # noqa: B018
        with pytest.raises(NotProvidedError, match=f"impel does not provide {name}: "):
            value()
