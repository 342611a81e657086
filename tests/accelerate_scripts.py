"""Run Accelerate's distributed test scripts (shipped in its wheel, ``accelerate/test_utils/scripts/``) against
Accelerate itself or, renamed on the fly, against impel, and report which checks pass.

A *check* is one call, in the script's ``main()``, of a function the script defines (``test_gather(state)``,
``training_check(use_seedable_sampler=True)``, ...). Every statement of ``main()`` runs in its own ``try`` so one
failure does not hide the rest; a check's label is its source text and its occurrence (loops run a check several
times). The renamed copy replaces the word ``accelerate`` by ``impel`` except in ``accelerate.test_utils`` (its
helpers, RegressionModel, ``are_the_same_tensors`` and the rest, stay Accelerate's and read the Accelerate state that
impel's Accelerator mirrors). Nothing is copied into this repository: the scripts are read from the installed package
and written to a temporary directory.

Example::

    results = run_script("test_ops.py", "impel", processes=2, workdir=tmp_path)
    results.passed   # {"test_gather(state)#1", ...}
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = ["test_script.py", "test_sync.py", "test_ops.py", "test_distributed_data_loop.py", "test_notebook.py",
           "external_deps/test_metrics.py"]

# Accelerate's own test helpers (``are_the_same_tensors`` and the rest) run unchanged: they read Accelerate's
# ``AcceleratorState``, which impel's Accelerator mirrors when Accelerate is imported
# (impel/accelerator/accelerate_state.py), as it is here through ``accelerate.test_utils``.

# test_metrics imports ``evaluate`` at the top for its GLUE check, which runs on GPUs only: an empty stand-in when
# the package is not installed lets its CPU checks run (under both targets alike).
_PRELUDE = '''
import importlib.util as _checks_util, sys as _checks_sys, types as _checks_types
if _checks_util.find_spec("evaluate") is None:
    _checks_sys.modules["evaluate"] = _checks_types.ModuleType("evaluate")
import json as _checks_json, os as _checks_os
_checks_seen = {}
def _checks_record(label, check, error):
    count = _checks_seen[label] = _checks_seen.get(label, 0) + 1
    rank = _checks_os.environ.get("RANK", "0")
    with open(_checks_os.environ["CHECKS_OUT"] + f".{rank}", "a") as fh:
        fh.write(_checks_json.dumps({"label": f"{label}#{count}", "check": check, "error": error}) + "\\n")
'''


def scripts_dir() -> Path:
    import accelerate

    return Path(accelerate.__file__).parent / "test_utils" / "scripts"


def rename(source: str) -> str:
    """Accelerate's names become impel's; ``accelerate.test_utils`` (the scripts' helpers) stays."""
    return re.sub(r"\baccelerate\b(?!\.test_utils)", "impel", source)


class _Instrument(ast.NodeTransformer):
    """Wrap each simple statement of ``main()`` in try/except, recording calls of the module's own functions."""

    def __init__(self, functions: set[str], skip: frozenset[str]) -> None:
        self.functions = functions
        self.skip = skip

    def _wrap(self, stmt: ast.stmt) -> list[ast.stmt]:
        if isinstance(stmt, (ast.Return, ast.Continue, ast.Break)):
            return [stmt]
        compound = isinstance(stmt, (ast.If, ast.For, ast.While, ast.With))
        label = ast.unparse(stmt).splitlines()[0][:120]
        if compound:  # each statement inside is wrapped; the block itself too (its condition may raise)
            for name in ("body", "orelse"):
                if hasattr(stmt, name):
                    setattr(stmt, name, [s for child in getattr(stmt, name) for s in self._wrap(child)] or
                            [ast.Pass()])
        call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
        check = call is not None and isinstance(call.func, ast.Name) and call.func.id in self.functions
        record = f"_checks_record({label!r}, {check}, ERROR)"
        if label in self.skip:  # not run: it would hang this target (see SKIP)
            return ast.parse(record.replace("ERROR", "'skipped'")).body
        failed, passed = record.replace("ERROR", "repr(_checks_error)[:300]"), record.replace("ERROR", "None")
        wrapper = ast.parse(f"try:\n    pass\nexcept BaseException as _checks_error:\n    {failed}\n"
                            f"else:\n    {passed}\n").body[0]
        assert isinstance(wrapper, ast.Try)
        wrapper.body = [stmt]
        return [wrapper]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        if node.name == "main":
            node.body = [s for stmt in node.body for s in self._wrap(stmt)]
        return node


def instrument(source: str, skip: frozenset[str] = frozenset()) -> str:
    tree = ast.parse(source)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name != "main"}
    tree = _Instrument(functions, skip).visit(tree)
    future = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    rest = [n for n in tree.body if n not in future]
    tree.body = future + ast.parse(_PRELUDE).body + rest
    return ast.unparse(ast.fix_missing_locations(tree))


@dataclass
class Results:
    passed: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # label -> the error (the first rank's)
    setup_failed: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    output: str = ""

    @property
    def checks(self) -> set[str]:
        return self.passed | set(self.failed)


# Checks not run, per target and number of processes, because they deadlock there (the other checks of the script
# would never run): Accelerate's join_uneven_inputs does nothing on CPU ranks (MULTI_CPU), so a rank with fewer
# batches leaves DDP's backward waiting forever. impel joins on CPU ranks too, so it runs them.
SKIP = {("accelerate", 2): frozenset({"test_can_join_uneven_inputs()", "test_join_can_override_even_batches()",
                                      "test_join_can_override_for_mixed_type_dataloaders()"})}


def run_script(name: str, target: str, processes: int, workdir: Path, timeout: float = 120) -> Results:
    """Run Accelerate's script ``name`` against ``target`` ("accelerate" or "impel") on ``processes`` CPU ranks;
    a check passes when it passed on every rank."""
    source = (scripts_dir() / name).read_text(encoding="utf-8")
    if target == "impel":
        source = rename(source)
    script = workdir / f"{target}_{processes}_{Path(name).name}"
    skip = SKIP.get((target, processes), frozenset())
    script.write_text(instrument(source, skip), encoding="utf-8")
    out = workdir / f"{script.stem}.checks"
    env = {**os.environ, "CHECKS_OUT": str(out), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1",
           "CUDA_VISIBLE_DEVICES": "", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "NUM_PROCESSES": str(processes)}
    # test_notebook starts its own NUM_PROCESSES processes (notebook_launcher) from one
    launched = 1 if "notebook" in name else processes
    cmd = [sys.executable, str(script)] if launched == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), str(script)]
    results = Results()
    try:
        proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
        results.returncode, results.output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as expired:
        results.output = f"timed out after {timeout}s\n{expired.stdout or ''}{expired.stderr or ''}"
    return _collect(results, out, launched)


def _collect(results: Results, out: Path, processes: int) -> Results:
    per_rank: list[dict[str, dict[str, object]]] = []
    for rank in range(processes):
        path = Path(f"{out}.{rank}")
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        per_rank.append({row["label"]: row for row in rows})
    labels = {label for rank in per_rank for label in rank}
    for label in sorted(labels):
        rows = [rank.get(label) for rank in per_rank]
        error = next((str(r["error"]) for r in rows if r is not None and r["error"] is not None), None)
        if any(r is None for r in rows):
            error = error or "did not run on every rank (a rank stopped or hung earlier)"
        is_check = any(r is not None and r["check"] for r in rows)
        if error == "skipped":
            continue
        if error is None:
            if is_check:
                results.passed.add(label)
        elif is_check:
            results.failed[label] = error
        else:
            results.setup_failed[label] = error
    return results


def measure(target: str = "accelerate") -> dict[tuple[str, int], list[str]]:
    """The checks ``target`` passes, per script and number of processes (what ACCELERATE_PASSES records)."""
    import tempfile

    table = {}
    for name in SCRIPTS:
        for processes in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                table[(name, processes)] = sorted(run_script(name, target, processes, Path(tmp), timeout=600).passed)
    return table


if __name__ == "__main__":  # python tests/accelerate_scripts.py [accelerate|impel]: print the table to record
    import pprint

    pprint.pprint(measure(sys.argv[1] if len(sys.argv) > 1 else "accelerate"), width=118)
