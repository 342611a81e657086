"""Loss curves as PNG files (matplotlib, the optional extra ``impel[plot]``).

``plot_loss`` draws one run's train and eval loss against the optimizer step; ``plot_runs`` draws several runs'
curves on shared axes (``examples/compare_runs.py``). Both read the Trainer's log history: a list of
``{"step": N, "loss": ...}`` / ``{"step": N, "eval_loss": ...}`` rows, as in ``output_dir/metrics.jsonl``.

Example::

    plot_loss(read_history("out/metrics.jsonl"), "out/loss.png")
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from impel.config.run_config import ConfigError

INSTALL_HINT = "pip install 'impel[plot]'  (or: pip install matplotlib)"


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    if not matplotlib_available():
        raise ConfigError(f"writing a loss plot needs matplotlib, which is not installed: {INSTALL_HINT}")
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def read_history(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The rows of a ``metrics.jsonl`` file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric in a log history, in order."""
    steps, values = [], []
    for row in history:
        if key in row and "step" in row and isinstance(row[key], (int, float)):
            steps.append(int(row["step"]))
            values.append(float(row[key]))
    return steps, values


def write_loss_plot(history: Sequence[Mapping[str, object]], path: str | os.PathLike[str],
                    want: bool | None) -> str | None:
    """The Trainer's end-of-run plot: ``want`` None writes it when matplotlib is installed (else prints how to get
    it), True requires matplotlib, False skips. Returns the path written, or None."""
    if want is False:
        return None
    if not matplotlib_available():
        if want:
            raise ConfigError(f"plot_loss=True needs matplotlib: {INSTALL_HINT}")
        print(f"impel: no loss plot written (matplotlib is not installed: {INSTALL_HINT})", flush=True)
        return None
    return plot_loss(history, path)


def plot_loss(history: Sequence[Mapping[str, object]], path: str | os.PathLike[str], title: str | None = None) -> str:
    """Train loss (line) and eval loss (line with markers) against the optimizer step; returns the PNG's path."""
    return plot_runs({"": history}, path, title=title or "training and evaluation loss")


def plot_runs(runs: Mapping[str, Sequence[Mapping[str, object]]], path: str | os.PathLike[str],
              title: str | None = None, x_label: str = "optimizer step") -> str:
    """Every run's train and eval loss on one chart; each run keeps one colour (train solid, eval dashed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    drawn = 0
    for index, (name, history) in enumerate(runs.items()):
        colour = f"C{index}"
        prefix = f"{name}: " if name else ""
        steps, values = series(history, "loss")
        if steps:
            ax.plot(steps, values, color=colour, linewidth=1.6, label=f"{prefix}train loss")
            drawn += 1
        steps, values = series(history, "eval_loss")
        if steps:
            ax.plot(steps, values, color=colour if name else "C1", linestyle="--", marker="o", markersize=5,
                    linewidth=1.6, label=f"{prefix}eval loss")
            drawn += 1
    if not drawn:
        plt.close(fig)
        raise ConfigError("the log history holds no 'loss' or 'eval_loss' values to plot; log at least once "
                          "(logging_steps) or evaluate (eval_strategy)")
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss")
    ax.set_title(title or "loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return str(out)
