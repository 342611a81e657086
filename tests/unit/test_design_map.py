"""docs/design.md's one-page map stays true: every file and folder it names exists, every ``module:name`` it names
imports, and its folder table lists every folder of ``impel/`` (the layers of tests/unit/test_architecture.py)."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _map() -> str:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    start = text.index("\n## Map\n")
    return text[start:text.index("\n## ", start + 1)]


def test_every_path_in_the_map_exists():
    paths = set(re.findall(r"`((?:impel|tests|docs)/[\w/.<>-]*)`", _map()))
    assert len(paths) > 20
    missing = sorted(p for p in paths if "<" not in p and not (ROOT / p).exists())
    assert not missing, f"docs/design.md's map names paths that do not exist: {missing}"


def test_every_name_in_the_map_imports():
    names = set(re.findall(r"`(impel(?:\.\w+)+):(\w+)`", _map()))
    assert len(names) >= 5
    for module, name in sorted(names):
        assert hasattr(importlib.import_module(module), name), f"{module}:{name} named in docs/design.md's map"


def test_the_map_lists_every_folder_of_impel():
    folders = {p.name for p in (ROOT / "impel").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    listed = set(re.findall(r"^\| `impel/(\w+)/` \|", _map(), flags=re.MULTILINE))
    assert listed == folders, f"folders without a row: {sorted(folders - listed)}, rows without a folder: " \
                              f"{sorted(listed - folders)}"
