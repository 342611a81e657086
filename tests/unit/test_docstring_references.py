"""Every impel path a docstring or comment names resolves: a module moved or renamed leaves no stale reference.

Two forms are checked in impel's own sources (string and comment tokens): dotted paths ``impel.x.y`` (module, then
attributes) and Sphinx roles (``:mod:`...```, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``) whose target is a
module path, full or relative (``:mod:`.staging``` must name an existing module of impel, by its last parts).
"""
from __future__ import annotations

import importlib
import io
import re
import tokenize
from pathlib import Path

import impel

ROOT = Path(impel.__file__).parent
DOTTED = re.compile(r"\bimpel(?:\.[A-Za-z_]\w*)+")
MOD_ROLE = re.compile(r":mod:`~?(\.?[A-Za-z_][\w.]*)`")


def _modules() -> set[str]:
    out = set()
    for path in ROOT.rglob("*.py"):
        parts = ["impel", *path.relative_to(ROOT).with_suffix("").parts]
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _texts(path: Path):
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            yield tok.start[0], tok.string


def test_every_impel_path_named_in_a_docstring_or_comment_resolves():
    modules = _modules()
    stale = []
    for path in sorted(ROOT.rglob("*.py")):
        where = path.relative_to(ROOT.parent)
        for line, text in _texts(path):
            for match in DOTTED.finditer(text):
                if not _resolves(match.group(0)):
                    stale.append(f"{where}:{line}: {match.group(0)}")
            for match in MOD_ROLE.finditer(text):
                name = match.group(1)
                if name.startswith("impel"):
                    ok = name in modules
                elif name.split(".")[0] in ("torch", "accelerate", "transformers", "deepspeed", "peft", "trl"):
                    continue
                else:
                    suffix = "." + name.lstrip(".")
                    ok = any(m.endswith(suffix) for m in modules)
                if not ok:
                    stale.append(f"{where}:{line}: :mod:`{name}`")
    assert not stale, "stale references (rename them to the module's current path):\n" + "\n".join(stale)


def test_the_check_sees_a_stale_path():
    assert not _resolves("impel.rank_health.note_normal_exit")  # moved to impel.runtime.ranks.rank_health
    assert _resolves("impel.runtime.ranks.rank_health.note_normal_exit")
