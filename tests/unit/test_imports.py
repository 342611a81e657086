"""``import impel`` stays light: optional engines are imported only where needed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "deepspeed")


def loaded_modules(*steps: str) -> list[dict[str, bool]]:
    """Run each step in one fresh interpreter; after each, which of HEAVY are in sys.modules."""
    lines = ["import json, sys", "snapshots = []"]
    for step in steps:
        lines += [step, f"snapshots.append({{m: m in sys.modules for m in {list(HEAVY)!r}}})"]
    lines.append("print(json.dumps(snapshots))")
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_impel_imports_neither_torch_nor_optional_engines():
    (after_import,) = loaded_modules("import impel\nassert impel.__version__")
    assert after_import == {"torch": False, "transformers": False, "deepspeed": False}


def test_the_accelerator_does_not_import_optional_engines():
    after_import, after_run = loaded_modules(
        "from impel import Accelerator",
        "import torch\nacc = Accelerator(cpu=True)\nm = torch.nn.Linear(2, 1)\n"
        "acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))")
    assert after_import["torch"] is True  # sanity: the probe really sees imports
    for snapshot in (after_import, after_run):
        assert snapshot["transformers"] is False
        assert snapshot["deepspeed"] is False


def test_public_names_resolve_lazily():
    import impel

    for name in impel.__all__:
        assert getattr(impel, name) is not None
    assert set(dir(impel)) == set(impel.__all__)


def test_unknown_attribute_raises_attribute_error():
    import impel

    with pytest.raises(AttributeError, match="no_such_thing"):
        impel.no_such_thing  # noqa: B018


def _compatibility_rows() -> list[tuple[str, list[str]]]:
    """(impel module path, names) of every supported row of docs/accelerate-compatibility.md's tables."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "accelerate-compatibility.md").read_text(encoding="utf-8")
    rows = []
    for module, names in re.findall(r"^\| `accelerate\.[\w.]+` \| `(impel\.[\w.]+)` supported \| ([^|]*) \|", page,
                                    flags=re.MULTILINE):
        rows.append((module, [n.strip() for n in names.split(",") if n.strip() and n.strip() != "see below"]))
    return rows


def test_every_public_path_of_the_compatibility_page_imports():
    """The folders moved the code, not the paths users import: each module path and name the compatibility page
    lists as supported resolves (``impel.utils``' own names are checked by test_dropin_surface)."""
    import importlib

    rows = _compatibility_rows()
    assert len(rows) >= 9 and ("impel.state", ["PartialState", "AcceleratorState", "GradientState"]) in rows
    for module, names in rows:
        face = importlib.import_module(module)
        missing = [name for name in names if not hasattr(face, name)]
        assert not missing, f"{module} lacks {missing}"
