"""The trackers impel builds from a name: JSONL (impel's own), TensorBoard, W&B, MLflow and trackio.

Each is constructed as Accelerate constructs its own (``Tracker(project_name, logging_dir, **init_kwargs)`` when it
needs a directory, else ``Tracker(project_name, **init_kwargs)``), so runs land where Accelerate puts them:
TensorBoard in ``logging_dir/project_name``, a W&B run in the W&B project ``project_name``, an MLflow run in the
experiment ``project_name`` (``$MLFLOW_EXPERIMENT_NAME`` wins) of MLflow's tracking URI, a trackio run in the
project ``project_name``. The packages are imported in ``start()``. A value a tracker cannot store is dropped with
one warning naming its key (``tracker_base.DropWarnings``) instead of silently.

Example::

    tb = TensorBoardTracker("my_project", "runs")
    tb.start(); tb.store_init_configuration({"lr": 1e-3}); tb.log({"loss": 0.5}, step=1); tb.finish()
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from impel.config import environment as env
from impel.config.run_config import ConfigError
from impel.trackers.base import DropWarnings, GeneralTracker, is_number, logger, on_main_process, plain
from impel.types import JSON

if TYPE_CHECKING:
    from mlflow import ActiveRun
    from torch.utils.tensorboard import SummaryWriter


class JSONLTracker(GeneralTracker):
    """One JSON object per ``log`` call (``{"step": N, ...}``) in ``logging_dir/run_name/metrics.jsonl`` (or
    ``path``); each line is flushed. ``history`` rows are written first, replacing the file: a resumed run rewrites
    the history up to its checkpoint, so lines an interrupted run wrote after that checkpoint do not linger."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str] = ".",
                 path: str | os.PathLike[str] | None = None, history: Sequence[Mapping[str, object]] = ()) -> None:
        super().__init__()
        self.path = Path(path) if path is not None else Path(logging_dir, run_name, "metrics.jsonl")
        self.history = list(history)
        self._file: Any = None

    @property
    def tracker(self) -> JSONLTracker:
        return self

    @on_main_process
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - open for the whole run
        for row in self.history:
            self._write(dict(row))

    def _write(self, row: dict[str, object]) -> None:
        # NaN/inf are written as JSON's non-standard tokens, which json.loads reads back
        self._file.write(json.dumps(plain(row, lists=True), allow_nan=True, default=str) + "\n")
        self._file.flush()

    @on_main_process
    def log(self, values: Mapping[str, object], step: int | None = None, **kwargs: object) -> None:
        self._write({"step": step, **{k: v for k, v in values.items() if k != "step"}})

    @on_main_process
    def finish(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


def _hparam(value: object) -> int | float | str | bool:
    """What TensorBoard's hparams take (numbers, strings, bools); anything else as its text."""
    return value if isinstance(value, (int, float, str, bool)) else str(value)


def _yaml_safe(value: object) -> JSON:
    if isinstance(value, Mapping):
        return {str(k): _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(v) for v in value]
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)


class TensorBoardTracker(GeneralTracker):
    """Event files in ``logging_dir/run_name`` (kwargs go to ``SummaryWriter``): numbers as scalars, strings as
    text, a dict of numbers as ``add_scalars`` (one sub-directory per key, TensorBoard's layout)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        super().__init__()
        self.run_name, self.logging_dir = run_name, os.path.join(logging_dir, run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None
        self._dropped = DropWarnings("TensorBoard", "numbers, strings and dicts of numbers")

    @on_main_process
    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> SummaryWriter:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, object]) -> None:
        """The config as TensorBoard hparams and as ``hparams.yml``, both in ``logging_dir/run_name/<time>/``."""
        import yaml

        stamp = str(time.time())
        values = plain(values, lists=True)
        self.writer.add_hparams({k: _hparam(v) for k, v in values.items()}, metric_dict={}, run_name=stamp)
        self.writer.flush()
        with open(os.path.join(self.logging_dir, stamp, "hparams.yml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(_yaml_safe(values), f)

    @on_main_process
    def log(self, values: Mapping[str, object], step: int | None = None, **kwargs: object) -> None:
        for key, value in plain(values, lists=True).items():
            if is_number(value):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict) and value and all(is_number(v) for v in value.values()):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                self._dropped(key, value)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: Mapping[str, object], step: int | None = None, **kwargs: object) -> None:
        """Accelerate's: each value a batch of images (``NCHW`` by default; ``dataformats=`` as SummaryWriter's)
        written with ``add_images``."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class _ProjectRunTracker(GeneralTracker):
    """A run object in the project ``run_name``, from ``_init(project=..., **init_kwargs)`` (W&B, trackio)."""

    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: object) -> None:
        super().__init__()
        self.run_name, self.init_kwargs = run_name, kwargs
        self.run: Any = None

    def _init(self, **kwargs: object) -> Any:
        raise NotImplementedError

    def _prepare(self, values: Mapping[str, object]) -> Mapping[str, object]:
        return values

    @on_main_process
    def start(self) -> None:
        self.run = self._init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def log(self, values: Mapping[str, object], step: int | None = None, **kwargs: object) -> None:
        self.run.log(self._prepare(values), step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class WandBTracker(_ProjectRunTracker):
    """A W&B run in the project ``run_name`` (kwargs go to ``wandb.init``: ``name``, ``entity``, ``tags``, ``dir``,
    ``mode``...). W&B stores strings, dicts and non-finite numbers itself; values go as given (tensors, arrays and
    its media objects included)."""

    name = "wandb"

    def _init(self, **kwargs: Any) -> Any:  # wandb.init's own keyword types
        import wandb

        return wandb.init(**kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, object]) -> None:
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log_images(self, values: Mapping[str, Iterable[object]], step: int | None = None,
                   **kwargs: object) -> None:
        """Accelerate's: each value a list of images (arrays, tensors or PIL images), logged as ``wandb.Image``."""
        import wandb

        for key, images in values.items():
            self.log({key: [wandb.Image(image) for image in images]}, step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[object]] | None = None,
                  dataframe: object = None, step: int | None = None, **kwargs: object) -> None:
        """Accelerate's: a ``wandb.Table`` from ``columns`` + ``data`` rows, or from a pandas ``dataframe``."""
        import wandb

        self.log({table_name: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step=step, **kwargs)


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment ``experiment_name`` (created with ``artifact_location=logging_dir`` when
    new), under MLflow's tracking URI (``$MLFLOW_TRACKING_URI``). As in Accelerate, ``$MLFLOW_EXPERIMENT_NAME``,
    ``$MLFLOW_RUN_ID``, ``$MLFLOW_TAGS`` (JSON) and ``$MLFLOW_NESTED_RUN`` win over the arguments. Metrics are
    numbers (non-finite ones included); other values are dropped with one warning per key."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike[str] | None = None,
                 run_id: str | None = None, tags: dict[str, object] | str | None = None, nested_run: bool = False,
                 run_name: str | None = None, description: str | None = None) -> None:
        super().__init__()
        overrides = env.mlflow_overrides()
        self.experiment_name = overrides.get("experiment_name", experiment_name)
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.run_id = overrides.get("run_id", run_id)
        tags = overrides.get("tags", tags)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        nested = overrides.get("nested_run", nested_run)
        self.nested_run = nested.strip().lower() in ("1", "true", "yes", "y", "on") if isinstance(nested, str) \
            else bool(nested)
        self.run_name, self.description = run_name, description
        self.active_run: Any = None
        self._dropped = DropWarnings("MLflow", "numbers as metrics")

    @on_main_process
    def start(self) -> None:
        import mlflow

        uri = mlflow.get_tracking_uri()
        if uri.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None:
            raise ConfigError(f"MLflow's tracking URI is {uri!r}, which mlflow-skinny cannot write: pip install "
                              "mlflow, or set MLFLOW_TRACKING_URI (a server, or file:///path/mlruns with "
                              "MLFLOW_ALLOW_FILE_STORE=true)")
        experiment_id = None  # no name: MLflow's active (default) experiment
        if self.experiment_name is not None:
            found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
            experiment_id = found[0].experiment_id if found else mlflow.create_experiment(
                name=self.experiment_name, artifact_location=self.logging_dir, tags=self.tags)
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @property
    def tracker(self) -> ActiveRun:
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict[str, object]) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        kept = []
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                logger.warning("MLflow did not store the parameter %r: its value is %d characters, MLflow takes at "
                               "most %d", key, len(str(value)), MAX_PARAM_VAL_LENGTH)
            else:
                kept.append((key, value))
        for i in range(0, len(kept), MAX_PARAMS_TAGS_PER_BATCH):  # MLflow takes at most 100 per call
            mlflow.log_params(dict(kept[i:i + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: Mapping[str, object], step: int | None = None, **kwargs: object) -> None:
        import mlflow

        metrics = {}
        for key, value in plain(values).items():
            if is_number(value):
                metrics[key] = float(value)
            else:
                self._dropped(key, value)
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: object, artifact_file: str, **save_kwargs: object) -> None:
        """Accelerate's: a matplotlib or plotly figure stored as the run's artifact ``artifact_file`` (e.g.
        ``"plots/loss.png"``)."""
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Accelerate's: every file under ``local_dir`` copied into the run's artifacts (under ``artifact_path``)."""
        import mlflow

        mlflow.log_artifacts(local_dir=os.fspath(local_dir), artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Accelerate's: one file copied into the run's artifacts (under ``artifact_path``)."""
        import mlflow

        mlflow.log_artifact(local_path=os.fspath(local_path), artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class TrackioTracker(_ProjectRunTracker):
    """A trackio run in the project ``run_name`` (kwargs go to ``trackio.init``: ``name``, ``space_id``...)."""

    name = "trackio"

    def _init(self, **kwargs: object) -> Any:
        import trackio

        return trackio.init(**kwargs)

    def _prepare(self, values: Mapping[str, object]) -> Mapping[str, object]:
        return plain(values)

    @on_main_process
    def store_init_configuration(self, values: dict[str, object]) -> None:
        self.run.config.update(plain(values))
