"""Metric sinks: a JSONL file always (on the main process), TensorBoard / W&B / MLflow when asked for.

Each tracker has ``log(values, step)`` and ``finish()``. A tracker that is asked for but not installed raises a
ConfigError naming the ``pip install`` that fixes it, on every rank (so no rank waits for one that failed).
The tracker packages are imported only when a tracker is built.

Example::

    trackers = make_trackers(["tensorboard"], "runs/a", run_name="a", config={"lr": 1e-3}, main_process=True,
                             jsonl_path="runs/a/metrics.jsonl")
    for t in trackers:
        t.log({"loss": 0.5}, step=10)
    for t in trackers:
        t.finish()
"""
from __future__ import annotations

import enum
import importlib.util
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError

# tracker name -> (module to import, pip package)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class LoggerType(str, enum.Enum):
    """Accelerate's tracker names, for ``Accelerator(log_with=LoggerType.TENSORBOARD)``; impel builds ``all``,
    ``tensorboard``, ``wandb`` and ``mlflow`` (the others raise when asked for, naming these)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"

    def __str__(self) -> str:
        return self.value


def installed_trackers() -> list[str]:
    """The trackers whose packages are importable here (what ``report_to="all"`` means)."""
    return [name for name, (module, _) in PACKAGES.items() if importlib.util.find_spec(module) is not None]


def check_installed(names: Iterable[str], what: str = "report_to", extra: Sequence[str] = ()) -> None:
    """Raise a ConfigError naming ``pip install <package>`` for the first tracker that is not installed."""
    for name in names:
        if name not in PACKAGES:
            raise ConfigError(f"{what}={name!r} is not a tracker impel knows; use one of "
                              f"{', '.join([*PACKAGES, *extra])}")
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{what}={name!r} needs the {package!r} package, which is not installed: "
                              f"pip install {package}  (or drop {name!r} from {what})")


def _plain(value: Any) -> Any:
    """A JSON-friendly scalar: tensors and numpy numbers become Python numbers, non-finite floats stay floats."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return str(value)
    return value


class Tracker:
    """Base class of the metric sinks."""

    name = "base"

    def log(self, values: Mapping[str, Any], step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and close; safe to call twice."""

    def native(self) -> Any:
        """The underlying object (SummaryWriter, wandb run, mlflow module; the tracker itself for JSONL)."""
        return self


class JSONLTracker(Tracker):
    """One JSON object per ``log`` call (``{"step": N, ...}``) appended to ``path``; each line is flushed.

    ``history`` rows are written first, replacing the file: a resumed run rewrites the history up to its
    checkpoint, so lines an interrupted run wrote after that checkpoint do not linger.
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str], history: Sequence[Mapping[str, Any]] = ()) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - open for the whole run
        for row in history:
            self._write(dict(row))

    def _write(self, row: dict[str, Any]) -> None:
        clean = {k: _plain(v) for k, v in row.items()}
        # NaN/inf are written as JSON's non-standard tokens, which json.loads reads back
        self._file.write(json.dumps(clean, allow_nan=True) + "\n")
        self._file.flush()

    def log(self, values: Mapping[str, Any], step: int) -> None:
        self._write({"step": step, **{k: v for k, v in values.items() if k != "step"}})

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardTracker(Tracker):
    """Scalars to a TensorBoard event file under ``logging_dir`` (needs ``pip install tensorboard``)."""

    name = "tensorboard"

    def __init__(self, logging_dir: str, run_name: str | None, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(logging_dir, "tensorboard", run_name or ""))
        self.writer.add_text("config", "```\n" + json.dumps(dict(config), indent=1, default=str) + "\n```")

    def log(self, values: Mapping[str, Any], step: int) -> None:
        for key, value in values.items():
            value = _plain(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()

    def native(self) -> Any:
        return self.writer


class WandBTracker(Tracker):
    """A Weights & Biases run (project from ``$WANDB_PROJECT``, else "impel"; needs ``pip install wandb``)."""

    name = "wandb"

    def __init__(self, logging_dir: str, run_name: str | None, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "impel"), name=run_name,
                              config=dict(config), dir=logging_dir)

    def log(self, values: Mapping[str, Any], step: int) -> None:
        self.run.log({k: _plain(v) for k, v in values.items()}, step=step)

    def finish(self) -> None:
        self.run.finish()

    def native(self) -> Any:
        return self.run


class MLflowTracker(Tracker):
    """An MLflow run (tracking URI from ``$MLFLOW_TRACKING_URI``; needs ``pip install mlflow``)."""

    name = "mlflow"

    def __init__(self, logging_dir: str, run_name: str | None, config: Mapping[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, values: Mapping[str, Any], step: int) -> None:
        numbers = {k: float(_plain(v)) for k, v in values.items()
                   if isinstance(_plain(v), (int, float)) and not isinstance(_plain(v), bool)}
        self.mlflow.log_metrics(numbers, step=step)

    def finish(self) -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run()

    def native(self) -> Any:
        return self.mlflow


TRACKER_CLASSES: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandBTracker, "mlflow": MLflowTracker}


def make_trackers(names: Sequence[str], logging_dir: str, run_name: str | None, config: Mapping[str, Any],
                  main_process: bool, jsonl_path: str | os.PathLike[str] | None = None,
                  history: Sequence[Mapping[str, Any]] = ()) -> list[Tracker]:
    """The JSONL tracker (when ``jsonl_path`` is given) plus ``names``, built on the main process only.

    Installation is checked on every rank first.
    """
    check_installed(names)
    if not main_process:
        return []
    trackers: list[Tracker] = []
    if jsonl_path is not None:
        trackers.append(JSONLTracker(jsonl_path, history))
    for name in names:
        trackers.append(TRACKER_CLASSES[name](logging_dir, run_name, config))
    return trackers


class AcceleratorTrackers:
    """What ``Accelerator(log_with=...)``, ``init_trackers``, ``log``, ``get_tracker`` and ``end_training`` use.

    ``log_with``: a tracker name, a list of them, ``"all"`` (every installed one) or None; besides Accelerate's
    names, ``"jsonl"`` writes ``<logging_dir>/<project_name>/metrics.jsonl``. Names are checked (and packages
    looked for) when the Accelerator is built, on every rank; trackers exist on the main process only.
    """

    def __init__(self, log_with: str | Sequence[str] | None) -> None:
        names = [log_with] if isinstance(log_with, str) else list(log_with or [])
        names = [n.value if isinstance(n, LoggerType) else n for n in names]
        if "all" in names:
            names = [n for n in names if n != "all"] + [n for n in installed_trackers() if n not in names]
        self.jsonl = "jsonl" in names
        self.names = [n for n in dict.fromkeys(names) if n != "jsonl"]
        check_installed(self.names, "log_with", extra=("jsonl", "all"))
        self.trackers: list[Tracker] = []
        self.started = False

    def start(self, project_name: str, logging_dir: str, config: Mapping[str, Any] | None,
              main_process: bool) -> None:
        if self.started:
            raise ConfigError("init_trackers() was already called; call it once per run (end_training() closes "
                              "the trackers)")
        jsonl = os.path.join(logging_dir, project_name, "metrics.jsonl") if self.jsonl else None
        self.trackers = make_trackers(self.names, logging_dir, project_name, dict(config or {}), main_process,
                                      jsonl_path=jsonl)
        self.started = True

    def log(self, values: Mapping[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(values, step)

    def get(self, name: str, unwrap: bool) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.native() if unwrap else tracker
        known = [t.name for t in self.trackers] or "none on this process (trackers live on the main process)"
        raise ValueError(f"no tracker named {name!r}; the active ones are {known}")

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.started = False
