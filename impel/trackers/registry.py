"""Experiment trackers, as Accelerate has them (``impel.trackers.registry`` is ``accelerate.tracking``'s path).

``Accelerator(log_with=...)`` takes tracker names (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"trackio"``,
impel's ``"jsonl"``, ``"all"`` for every installed one), ``LoggerType`` members, names registered with
``register_tracker_class`` and ``GeneralTracker`` instances. ``init_trackers(project_name, config, init_kwargs)``
builds each named tracker with ``init_kwargs[name]``, starts them all and stores ``config``;
``log(values, step, log_kwargs)`` passes ``log_kwargs[name]`` to each. Trackers run on the main process, and on
every process those whose ``main_process_only`` is False. A name that is not installed raises a ConfigError naming
the ``pip install`` when the Accelerator is built, on every rank (so no rank waits for one that failed).

Example::

    accelerator = Accelerator(log_with=["tensorboard", "wandb"], project_dir="runs")
    accelerator.init_trackers("my_project", config={"lr": 1e-3}, init_kwargs={"wandb": {"name": "first"}})
    accelerator.log({"loss": 0.5}, step=10, log_kwargs={"wandb": {"commit": True}})
    accelerator.end_training()
"""
from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from impel.config.run_config import ConfigError
from impel.trackers.base import GeneralTracker, LoggerType, on_main_process
from impel.trackers.builtin import JSONLTracker, MLflowTracker, TensorBoardTracker, TrackioTracker, WandBTracker

__all__ = ["GeneralTracker", "LoggerType", "on_main_process", "get_available_trackers", "register_tracker_class",
           "JSONLTracker", "TensorBoardTracker", "WandBTracker", "MLflowTracker", "TrackioTracker",
           "LOGGER_TYPE_TO_CLASS"]

# tracker name -> (module to import, pip package)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}
TRAINER_TRACKERS = ("tensorboard", "wandb", "mlflow")  # the default candidates of installed_trackers

LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandBTracker, "mlflow": MLflowTracker, "trackio": TrackioTracker,
    "jsonl": JSONLTracker}

Tracker = GeneralTracker  # a short alias


def installed_trackers(candidates: Iterable[str] = TRAINER_TRACKERS) -> list[str]:
    """The trackers among ``candidates`` whose packages are importable here (what ``"all"`` means)."""
    return [name for name in candidates if importlib.util.find_spec(PACKAGES[name][0]) is not None]


def get_available_trackers() -> list[LoggerType]:
    """Accelerate's list of the built-in trackers installed here."""
    return [LoggerType(name) for name in installed_trackers(PACKAGES)]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``log_with="<tracker_class.name>"`` build ``tracker_class`` (as Accelerate's function does)."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"`tracker_class` must be a subclass of `GeneralTracker`, but got {tracker_class}.")
    if not getattr(tracker_class, "name", None):
        raise ValueError("The tracker class to register must define a non-empty `name` attribute.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError("The tracker class to register must define a `requires_logging_directory` class attribute.")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"A tracker with the name '{tracker_class.name}' is already registered and will be overwritten "
                      f"by {tracker_class}. This is especially significant when shadowing a built-in tracker.",
                      stacklevel=2)
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def check_installed(names: Iterable[str], what: str = "report_to", extra: Sequence[str] = ()) -> None:
    """Raise a ConfigError naming ``pip install <package>`` for the first tracker that is not installed."""
    for name in names:
        if name not in PACKAGES:
            if name in LOGGER_TYPE_TO_CLASS and what != "report_to":
                continue  # jsonl, or a class registered with register_tracker_class
            known = [*(PACKAGES if what != "report_to" else TRAINER_TRACKERS), *extra]
            raise ConfigError(f"{what}={name!r} is not a tracker impel knows; use one of {', '.join(known)}")
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{what}={name!r} needs the {package!r} package, which is not installed: "
                              f"pip install {package}  (or drop {name!r} from {what})")


class AcceleratorTrackers:
    """What ``Accelerator(log_with=...)``, ``init_trackers``, ``log``, ``trackers``, ``get_tracker`` and
    ``end_training`` use. Names are checked (and packages looked for) when the Accelerator is built, on every rank.
    """

    def __init__(self, log_with: object) -> None:  # a name, LoggerType or tracker, a list of them, or None
        given = list(log_with) if isinstance(log_with, (list, tuple)) else ([] if log_with is None else [log_with])
        entries: list[str | GeneralTracker] = [
            e if isinstance(e, GeneralTracker) else str(e.value if isinstance(e, LoggerType) else e) for e in given]
        if "all" in entries:
            entries = [e for e in entries if e != "all"]
            entries += [n for n in installed_trackers(PACKAGES) if n not in entries]
        self.entries: list[str | GeneralTracker] = []
        for entry in entries:  # a name once, in order; instances as given
            if not isinstance(entry, str) or entry not in self.entries:
                self.entries.append(entry)
        self.names = [e for e in self.entries if isinstance(e, str)]
        check_installed(self.names, "log_with", extra=[n for n in LOGGER_TYPE_TO_CLASS if n not in PACKAGES] + ["all"])
        self.trackers: list[GeneralTracker] = []
        self.started = False

    @property
    def log_with(self) -> list[str | GeneralTracker]:
        return list(self.entries)

    def check_logging_dir(self, logging_dir: object) -> None:
        """As Accelerate: a tracker named in ``log_with`` that writes files (``requires_logging_directory``, as
        TensorBoard) needs a logging directory; a ValueError when there is none."""
        for name in self.names:
            cls = LOGGER_TYPE_TO_CLASS.get(name)
            if logging_dir is None and cls is not None and cls.requires_logging_directory:
                raise ValueError(f"Logging with `{name}` requires a `logging_dir` to be passed in. Pass "
                                 "Accelerator(project_dir=...) or project_config=ProjectConfiguration("
                                 "logging_dir=...)")

    def start(self, project_name: str, logging_dir: str, config: Mapping[str, object] | None,
              init_kwargs: Mapping[str, Mapping[str, Any]] | None, main_process: bool) -> None:
        if self.started:
            raise ConfigError("init_trackers() was already called; call it once per run (end_training() closes "
                              "the trackers)")
        init_kwargs = init_kwargs or {}
        trackers: list[GeneralTracker] = []
        for entry in self.entries:
            if isinstance(entry, GeneralTracker):  # built by the user: init_kwargs do not reach it (as Accelerate)
                if main_process or not entry.main_process_only:
                    trackers.append(entry)
                continue
            cls = LOGGER_TYPE_TO_CLASS[entry]
            if main_process or not cls.main_process_only:
                args = (project_name, logging_dir) if cls.requires_logging_directory else (project_name,)
                trackers.append(cls(*args, **dict(init_kwargs.get(entry, {}))))
        self.trackers, self.started = trackers, True
        for tracker in trackers:
            tracker.start()
        if config is not None:
            for tracker in trackers:
                tracker.store_init_configuration(dict(config))

    def log(self, values: Mapping[str, object], step: int | None, log_kwargs: Mapping[str, Mapping[str, object]] | None,
            jsonl_step: int) -> None:
        """``step`` as given (None lets each tracker count), except that JSONL rows always carry one."""
        for tracker in self.trackers:
            at = jsonl_step if step is None and isinstance(tracker, JSONLTracker) else step
            tracker.log(dict(values), step=at, **dict((log_kwargs or {}).get(tracker.name, {})))

    def get(self, name: str, unwrap: bool) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        asked = set(self.names) | {t.name for t in self.entries if isinstance(t, GeneralTracker)}
        if not self.trackers or name in asked:  # it runs on the main process only: a no-op stand-in here
            return GeneralTracker(_blank=True)
        raise ValueError(f"{name} is not an available tracker stored inside the `Accelerator`; the active ones are "
                         f"{[t.name for t in self.trackers]}")

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.started = False
