"""``impel compare RUN RUN [...]``: are these runs' loss curves alike?

Each RUN is a ``metrics.jsonl`` file (the Trainer's, or the ``jsonl`` tracker's) or a directory holding one. The
first run is the baseline. Curves are aligned on the optimizer step, or with ``--align samples`` on the samples
seen (for runs whose global batch differs: one process vs FSDP on several, say), where the other run's curve is
interpolated at the baseline's points. For each run the table shows, against the baseline, the mean and largest
relative difference of the train loss and of the eval loss, the final eval metrics and the throughput; a PNG
draws every curve. With ``--tolerance T`` the command exits 1 when a mean relative difference exceeds T.

Example::

    impel compare runs/single runs/fsdp --align samples --tolerance 0.05 --plot compare.png
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from impel.config.run_config import ConfigError

METRICS_FILE = "metrics.jsonl"
_T = TypeVar("_T")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("compare", help="compare the loss curves of several runs (metrics.jsonl)",
                              description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("runs", nargs="+", metavar="RUN", help="a metrics.jsonl file or a directory holding one; the "
                   "first is the baseline")
    p.add_argument("--name", action="append", default=None, metavar="NAME",
                   help="a name per run, in order (default: the directory names)")
    p.add_argument("--align", choices=("step", "samples"), default="step",
                   help="compare at the same optimizer step (default), or at the same number of samples seen")
    p.add_argument("--samples_per_step", type=float, action="append", default=None, metavar="N",
                   help="global samples per optimizer step, per run in order (default: from the Trainer's final "
                   "train_samples_per_second / train_steps_per_second)")
    p.add_argument("--metric", default="loss", help="the train curve's key (default: loss)")
    p.add_argument("--tolerance", type=float, default=None, metavar="T",
                   help="exit 1 when a run's mean relative difference (train or eval) exceeds T, e.g. 0.05")
    p.add_argument("--plot", default="compare.png", metavar="PNG",
                   help="where to draw the curves (default: compare.png; needs matplotlib)")
    p.add_argument("--no_plot", action="store_true", help="draw nothing")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON instead of a table")
    p.set_defaults(handler=main)


# --- reading --------------------------------------------------------------------------------------------------------
def metrics_file(run: str | Path) -> Path:
    """The ``metrics.jsonl`` a RUN argument names."""
    path = Path(run)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ConfigError(f"run {str(run)!r} does not exist; pass a metrics.jsonl file or a run directory")
    if (path / METRICS_FILE).is_file():
        return path / METRICS_FILE
    found = sorted(path.rglob(METRICS_FILE))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(str(f) for f in found[:4])})"
        raise ConfigError(f"run directory {str(run)!r} holds {what} {METRICS_FILE} files; pass the file itself")
    return found[0]


def read_rows(path: Path) -> list[dict[str, object]]:
    """The JSON rows of a metrics.jsonl (the Trainer's reader), a ConfigError naming the file when it is not one."""
    from impel.trainer.plot import read_history

    try:
        return [row for row in read_history(path) if isinstance(row, dict)]
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} holds a line that is not JSON ({exc.msg}); is it a metrics.jsonl?") from None


def curve(rows: Sequence[Mapping[str, object]], key: str) -> list[tuple[float, float]]:
    """(step, value) of one metric, in order; a later row for the same step replaces an earlier one (resumed runs
    rewrite their history)."""
    from impel.trainer.plot import series

    steps, values = series(rows, key)
    return sorted(dict(zip(map(float, steps), values)).items())


@dataclass
class Run:
    name: str
    path: Path
    rows: list[dict[str, object]]
    samples_per_step: float | None = None
    summary: dict[str, object] = field(default_factory=dict)

    @classmethod
    def load(cls, name: str, run: str | Path, samples_per_step: float | None) -> Run:
        path = metrics_file(run)
        rows = read_rows(path)
        summary: dict[str, Any] = next((r for r in reversed(rows) if "train_runtime" in r), {})
        if samples_per_step is None and summary.get("train_steps_per_second"):
            samples_per_step = summary["train_samples_per_second"] / summary["train_steps_per_second"]
        return cls(name, path, rows, samples_per_step, summary)

    def x(self, step: float, align: str) -> float:
        if align == "step":
            return step
        if not self.samples_per_step:
            raise ConfigError(f"--align samples needs run {self.name!r}'s samples per step: its {self.path} has no "
                              "Trainer summary row (train_samples_per_second); pass --samples_per_step per run")
        return step * self.samples_per_step

    def shared_steps(self, key: str) -> str | None:
        """A note when several rows of ``key`` share a step (only the last of each is compared), else None."""
        from collections import Counter

        from impel.trainer.plot import series

        counts = {step: n for step, n in Counter(series(self.rows, key)[0]).items() if n > 1}
        if not counts:
            return None
        listed = ", ".join(f"step {step}: {n} rows" for step, n in sorted(counts.items())[:5])
        more = f" and {len(counts) - 5} more steps" if len(counts) > 5 else ""
        return (f"run {self.name!r} ({self.path}) logs {key!r} more than once at a step ({listed}{more}); only the "
                "last row of each step is compared. A resumed run rewrites its history this way; a loop that logs "
                "without stepping the optimizer logs every row at one step: pass log(..., step=N) a step that grows")

    def final_eval(self) -> dict[str, float]:
        row: dict[str, object] = next((r for r in reversed(self.rows) if any(k.startswith("eval_") for k in r)), {})
        return {k: float(v) for k, v in row.items()
                if k.startswith("eval_") and isinstance(v, (int, float)) and not k.endswith(("_runtime", "per_second"))}


# --- comparing ------------------------------------------------------------------------------------------------------
def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """The curve's value at ``x`` (linear between points), or None outside its range."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1] if x == points[-1][0] else None


def relative_differences(base: Sequence[tuple[float, float]], other: Sequence[tuple[float, float]],
                         exact: bool) -> list[float]:
    """|other - base| / |base| at the baseline's points: the same x when ``exact``, else interpolated."""
    lookup = dict(other)
    out = []
    for x, value in base:
        theirs = lookup.get(x) if exact else _interpolate(other, x)
        if theirs is not None and math.isfinite(value) and math.isfinite(theirs) and value != 0:
            out.append(abs(theirs - value) / abs(value))
    return out


def compare(runs: Sequence[Run], align: str, metric: str = "loss") -> list[dict[str, object]]:
    """One row per run against the first: points compared, mean / max relative difference of the train and eval
    curves, final eval metrics, throughput."""
    base = runs[0]
    exact = align == "step"
    table = []
    for run in runs:
        row: dict[str, object] = {"run": run.name, "file": str(run.path)}
        for label, key in (("train", metric), ("eval", "eval_loss")):
            mine = [(run.x(s, align), v) for s, v in curve(run.rows, key)]
            theirs = [(base.x(s, align), v) for s, v in curve(base.rows, key)]
            diffs = relative_differences(theirs, mine, exact) if mine and theirs else []
            row[f"{label}_points"] = len(diffs)
            row[f"{label}_mean_rel"] = sum(diffs) / len(diffs) if diffs else None
            row[f"{label}_max_rel"] = max(diffs) if diffs else None
            row[f"final_{label}"] = mine[-1][1] if mine else None
        row["eval"] = run.final_eval()
        row["samples_per_second"] = run.summary.get("train_samples_per_second")
        table.append(row)
    if len(runs) > 1 and not any(r["train_points"] or r["eval_points"] for r in table[1:]):
        how = "optimizer steps" if exact else "sample counts"
        raise ConfigError(f"the runs share no {how} to compare {metric!r} or eval_loss at; log at the same steps "
                          "(logging_steps), or use --align samples for runs with different batch sizes")
    return table


def exceeded(table: Sequence[Mapping[str, Any]], tolerance: float) -> list[str]:
    """What goes past ``tolerance``, as readable lines (empty when everything is within it)."""
    out = []
    for row in table[1:]:
        for label in ("train", "eval"):
            value = row[f"{label}_mean_rel"]
            if value is not None and value > tolerance:
                out.append(f"{row['run']}: {label} loss differs from {table[0]['run']} by {value:.2%} on average "
                           f"(tolerance {tolerance:.2%})")
    return out


def _cell(value: object, percent: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.2%}" if percent else (f"{value:.4g}" if isinstance(value, float) else str(value))


def format_table(table: Sequence[Mapping[str, Any]]) -> str:
    head = ["run", "train pts", "train mean rel", "train max rel", "final train", "eval pts", "eval mean rel",
            "eval max rel", "final eval", "samples/s"]
    lines = [head]
    for row in table:
        lines.append([row["run"], _cell(row["train_points"]), _cell(row["train_mean_rel"], True),
                      _cell(row["train_max_rel"], True), _cell(row["final_train"]), _cell(row["eval_points"]),
                      _cell(row["eval_mean_rel"], True), _cell(row["eval_max_rel"], True), _cell(row["final_eval"]),
                      _cell(row["samples_per_second"])])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    extra = [f"{row['run']}: " + ", ".join(f"{k}={v:.4g}" for k, v in row["eval"].items())
             for row in table if row["eval"]]
    return "\n".join(text + (["", "final eval metrics:", *extra] if extra else []))


def plot(runs: Sequence[Run], align: str, path: str, metric: str) -> str:
    from impel.trainer.plot import plot_runs

    histories = {}
    for run in runs:
        rows = []
        for key in (metric, "eval_loss"):
            rows += [{"step": run.x(s, align), "loss" if key == metric else key: v} for s, v in curve(run.rows, key)]
        histories[run.name] = rows
    label = "optimizer step" if align == "step" else "samples seen"
    return plot_runs(histories, path, title=f"{len(runs)} runs, aligned on {label}", x_label=label)


def _per_run(values: list[_T] | None, count: int, what: str) -> Sequence[_T | None]:
    if values is None:
        return [None] * count
    if len(values) != count:
        raise ConfigError(f"{what} was given {len(values)} time(s) for {count} runs; give it once per run, in order")
    return values


def main(ns: argparse.Namespace) -> int:
    if len(ns.runs) < 2:
        raise ConfigError("impel compare needs at least two runs (the first is the baseline)")
    if ns.tolerance is not None and ns.tolerance < 0:
        raise ConfigError(f"--tolerance {ns.tolerance} must be >= 0 (a fraction: 0.05 = 5%)")
    names = [n or Path(r).resolve().name for n, r in zip(_per_run(ns.name, len(ns.runs), "--name"), ns.runs)]
    if len(set(names)) < len(names):
        names = [f"{i}:{n}" for i, n in enumerate(names)]
    sps = _per_run(ns.samples_per_step, len(ns.runs), "--samples_per_step")
    runs = [Run.load(name, run, s) for name, run, s in zip(names, ns.runs, sps)]
    for note in filter(None, (run.shared_steps(key) for run in runs for key in (ns.metric, "eval_loss"))):
        print(f"impel compare: note: {note}", file=sys.stderr)
    table = compare(runs, ns.align, ns.metric)
    print(json.dumps(table, indent=2) if ns.json else format_table(table))
    if not ns.no_plot:
        from impel.trainer.plot import matplotlib_available

        if matplotlib_available():
            print(f"curves: {plot(runs, ns.align, ns.plot, ns.metric)}")
        else:
            print("no plot written: matplotlib is not installed (pip install matplotlib, or pass --no_plot)")
    problems = exceeded(table, ns.tolerance) if ns.tolerance is not None else []
    for line in problems:
        print(f"impel compare: {line}")
    return 1 if problems else 0
