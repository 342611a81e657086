"""Which library's Accelerator a launched script builds, said in one line before any rank starts.

A script written for Accelerate's stack (TRL's ``SFTTrainer``, transformers' ``Trainer``, ``from accelerate import
Accelerator``) and never touching impel builds Accelerate's own ``Accelerator`` in every rank, also under ``impel
launch``: the ranks get the process group and Accelerate's ``ACCELERATE_*`` variables, but impel's run config (the
strategy, FSDP or DeepSpeed settings, impel's checkpoints) reaches nothing. Rather than let ``impel launch --use_fsdp
sft.py`` train DDP on Accelerate in silence, the launcher reads the script (its imports, without running it) and says
so in one line, with the line that moves it onto impel::

    impel launch: sft.py imports trl (SFTTrainer) and never impel: it builds Accelerate's own Accelerator and trains
    on Accelerate, not impel (impel's run config does not reach it); to run it on impel: ...

A script that mentions ``impel`` anywhere (``import impel``, ``from impel.trainer import on_impel``) gets no line; so
does one whose source cannot be found or parsed (a ``--no_python`` program, a module not on the path).
"""
from __future__ import annotations

import ast
import importlib.util
import os

__all__ = ["accelerate_route_note"]

_STACK = ("accelerate", "trl", "transformers")  # the libraries whose code builds accelerate.Accelerator


def accelerate_route_note(command: list[str]) -> str | None:
    """The one line for the script ``command`` runs (``[script, *args]`` or ``["-m", module, *args]``), or None
    when it touches impel or builds no Accelerator we can see."""
    path = _script_file(command)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    if "impel" in source:
        return None
    found = _imports(tree)
    trainers = {lib: sorted(n for n in found.get(lib, ()) if n.endswith("Trainer")) for lib in ("trl", "transformers")}
    libs: list[str] = [lib for lib in ("trl", "accelerate") if lib in found]
    libs += ["transformers"] if trainers["transformers"] else []
    if not libs:
        return None
    shown = {lib: trainers.get(lib) or sorted(n for n in found[lib] if n) for lib in libs}
    named = ", ".join(f"{lib} ({', '.join(shown[lib][:4])})" if shown[lib] else lib for lib in libs)
    first = (trainers["trl"] + trainers["transformers"])[:1]
    fix = (f"wrap the trainer class, `from impel.trainer import on_impel` and `on_impel({first[0]})(...)`"
           if first else "`from impel import Accelerator` in place of accelerate's")
    return (f"{os.path.basename(path)} imports {named} and never impel: it builds Accelerate's own Accelerator and "
            "trains on Accelerate, not impel (impel's run config, its strategy and checkpoints do not reach it; "
            f"the ranks get Accelerate's ACCELERATE_* variables only); to run it on impel, {fix} "
            "(docs/migration.md, 'TRL, PEFT and other libraries')")


def _script_file(command: list[str]) -> str | None:
    if not command:
        return None
    if command[0] != "-m":
        script = command[0]
        if os.path.isdir(script):
            script = os.path.join(script, "__main__.py")
        return script if script.endswith(".py") and os.path.isfile(script) else None
    try:
        spec = importlib.util.find_spec(command[1])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        main = os.path.join(os.path.dirname(spec.origin), "__main__.py")
        return main if os.path.isfile(main) else None
    return spec.origin


def _imports(tree: ast.AST) -> dict[str, set[str]]:
    """{library: names imported from it} for the stack's libraries ('' for a plain ``import lib``)."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in _STACK:
                    found.setdefault(top, set()).add("")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in _STACK:
                found.setdefault(top, set()).update(alias.name for alias in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in _STACK:
            found.setdefault(node.value.id, set()).add(node.attr)  # transformers.Trainer(...) after import transformers
    return found
