"""Run the benchmarks in this folder, print a table per benchmark and write ``results/<name>.json``.

A benchmark is any ``benchmarks/<name>.py`` (other than this file and ``_*.py`` helpers) that defines ``NAME``,
``DESCRIPTION`` and ``run(quick: bool = False) -> dict`` returning at least ``rows`` (a list of flat dicts, printed
as a table) and optionally ``summary`` (lines printed under it). Each benchmark runs in its own fresh interpreter,
so process-wide state (impel's and accelerate's singletons, imported modules, warmed caches) never leaks from one
into the next.

    python benchmarks/run.py              # every benchmark
    python benchmarks/run.py overhead     # just these
    python benchmarks/run.py --quick      # short smoke run (figures are not meaningful)
    python benchmarks/run.py --list
"""
from __future__ import annotations

import _common  # noqa: F401  (first: pins OMP_NUM_THREADS for this process and the children)

# isort: split

import argparse
import datetime
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = _common.HERE


def discover() -> list[str]:
    """Modules that define NAME; standalone tools in this folder (soak_exit.py, mutants.py) are run by hand."""
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem != "run" and not p.stem.startswith("_")
                  and any(line.startswith("NAME = ") for line in p.read_text(encoding="utf-8").splitlines()))


def run_worker(module_name: str, quick: bool, results: Path) -> int:
    """In the child interpreter: run one benchmark and write its JSON."""
    module = importlib.import_module(module_name)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    payload: dict[str, Any] = module.run(quick=quick)
    payload.setdefault("name", module.NAME)
    payload.setdefault("description", getattr(module, "DESCRIPTION", ""))
    payload.setdefault("environment", _common.environment())  # every result names the commit it measured
    payload["started_at"] = started.isoformat(timespec="seconds")
    payload["wall_seconds"] = round(time.perf_counter() - t0, 2)
    payload["command"] = " ".join([Path(sys.executable).name, "benchmarks/run.py", module_name]
                                  + (["--quick"] if quick else []))
    _common.write_json(module.NAME, payload, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run impel's benchmarks.")
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="short smoke run; the figures are not meaningful")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--results", type=Path, default=_common.RESULTS, help="where to write <name>.json")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a row has a target and misses it (noisy on a shared machine)")
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        return run_worker(args.worker, args.quick, args.results)

    available = discover()
    if args.list:
        for name in available:
            module_doc = (importlib.import_module(name).__doc__ or "").strip().splitlines()
            print(f"{name:12s} {module_doc[0] if module_doc else ''}")
        return 0
    unknown = [n for n in args.names if n not in available]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}")
    selected = args.names or available

    failed: list[str] = []
    missed: list[str] = []
    for name in selected:
        print(f"== {name}{' (quick)' if args.quick else ''}", flush=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--results", str(args.results)]
        if args.quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            print(f"!! {name} failed (exit {proc.returncode})", flush=True)
            failed.append(name)
            continue
        path = args.results / f"{name}.json"
        payload = json.loads(path.read_text())
        print(_common.format_table(payload.get("rows", [])))
        for line in payload.get("summary", []):
            print(line)
        try:
            shown = path.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            shown = path
        print(f"-> {shown} ({time.perf_counter() - t0:.0f} s)\n", flush=True)
        missed += [f"{name}: " + " ".join(f"{k}={v}" for k, v in r.items() if isinstance(v, str) or k == "ranks")
                   for r in payload.get("rows", []) if r.get("ok") is False]

    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    if missed:
        print("targets missed:\n  " + "\n  ".join(missed))
        if args.check:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
