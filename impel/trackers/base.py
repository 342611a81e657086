"""The custom-tracker contract: Accelerate's ``GeneralTracker``, its ``on_main_process`` decorator and ``LoggerType``
(reach them in ``impel.trackers.registry``, Accelerate's paths), plus what the built-in trackers share: plain values
and one warning per key a tracker cannot store.

Example::

    class PrintTracker(GeneralTracker):
        name = "print"
        requires_logging_directory = False

        @property
        def tracker(self):
            return None

        def log(self, values, step=None, **kwargs):
            print(step, values)

    accelerator = Accelerator(log_with=[PrintTracker()])
"""
from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeGuard, TypeVar, overload

logger = logging.getLogger("impel.trackers.registry")

_Self = TypeVar("_Self")
_P = ParamSpec("_P")
_R = TypeVar("_R")


class _ValueContains(enum.EnumMeta):
    """``"wandb" in LoggerType`` is True, as with Accelerate's enums."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class LoggerType(str, enum.Enum, metaclass=_ValueContains):
    """Accelerate's tracker names, for ``Accelerator(log_with=LoggerType.TENSORBOARD)``; impel builds ``all``,
    ``tensorboard``, ``wandb``, ``mlflow`` and ``trackio`` (the others raise when asked for, naming these)."""

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

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


def _is_main_process() -> bool:
    from impel.runtime.ranks.process import (
        current_topology,  # the live state's rank, else torchrun's; initialises nothing
    )

    return current_topology().rank == 0


def on_main_process(function: Callable[Concatenate[_Self, _P], _R]) -> Callable[Concatenate[_Self, _P], _R | None]:
    """Decorate a tracker method: it runs on the main process only when the tracker's ``main_process_only`` is True
    (elsewhere it returns None); with ``main_process_only = False`` it runs on every process."""

    @functools.wraps(function)
    def run_where_allowed(self: _Self, *args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        if getattr(self, "main_process_only", False) and not _is_main_process():
            return None
        return function(self, *args, **kwargs)

    return run_where_allowed


class GeneralTracker:
    """The base class of every tracker (Accelerate's contract, so a custom tracker written for Accelerate runs).

    A subclass sets ``name`` (what ``log_kwargs`` / ``init_kwargs`` and ``get_tracker`` use) and
    ``requires_logging_directory`` (a class built from ``log_with="name"`` then gets ``logging_dir`` as its second
    argument), and defines a ``tracker`` property (the underlying object, for ``get_tracker(name, unwrap=True)``).
    ``main_process_only = False`` makes the Accelerator start it, log to it and finish it on every process.
    ``start()`` is called by ``init_trackers``, then ``store_init_configuration(config)`` when a config is given,
    ``log(values, step, **log_kwargs[name])`` by ``accelerator.log`` and ``finish()`` by ``end_training``.
    """

    main_process_only = True
    # declared, not defined: each subclass defines them, and __init__ names the ones a subclass forgot
    name: str
    requires_logging_directory: bool
    if TYPE_CHECKING:
        @property
        def tracker(self) -> object: ...

    def __init__(self, _blank: bool = False) -> None:
        if _blank:  # what get_tracker returns on a process where the tracker does not run: every call is a no-op
            return
        missing = [f"`{a}`" for a in ("name", "requires_logging_directory") if not hasattr(self, a)]
        if "tracker" not in dir(self):  # a property that may only work after start()
            missing.append("`tracker`")
        if missing:
            raise NotImplementedError("The implementation for this tracker class is missing the following required "
                                      f"attributes. Please define them in the class definition: {', '.join(missing)}")

    def start(self) -> None:
        """Open the run (called by ``init_trackers``, after the process group exists)."""

    def store_init_configuration(self, values: dict[str, object]) -> None:
        """Store ``values`` as the run's hyper-parameters."""

    def log(self, values: dict[str, object], step: int | None = None, **kwargs: object) -> None:
        """Log ``values`` at ``step``; ``kwargs`` are ``log_kwargs[self.name]`` from ``accelerator.log``."""

    def finish(self) -> None:
        """Flush and close the run."""


@overload
def plain(value: Mapping[str, object], lists: bool = False) -> dict[str, object]: ...
@overload
def plain(value: object, lists: bool = False) -> object: ...
def plain(value: object, lists: bool = False) -> object:
    """0-d tensors and numpy scalars as Python numbers, inside dicts, lists and tuples too; with ``lists`` larger
    tensors and arrays as (nested) lists (what Accelerate's TensorBoard tracker does), else left as they are."""
    if isinstance(value, Mapping):
        return {k: plain(v, lists) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, lists) for v in value]
    ndim = getattr(value, "ndim", None)
    if hasattr(value, "tolist") and ndim is not None and (ndim == 0 or lists):
        if hasattr(value, "detach"):
            tensor = value.detach().cpu()
            value = tensor.float() if str(tensor.dtype) == "torch.bfloat16" else tensor  # no bfloat16 in Python
        return value.tolist()
    return value


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float))  # bool included, as Accelerate's trackers treat it


class DropWarnings:
    """Warns once per key that a tracker could not store, naming the key, the value and what the tracker takes."""

    def __init__(self, tracker: str, accepts: str) -> None:
        self.tracker, self.accepts = tracker, accepts
        self.seen: set[str] = set()

    def __call__(self, key: str, value: object) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        logger.warning("%s did not log %r = %s (%s): %s stores %s; later values of %r are dropped without another "
                       "warning", self.tracker, key, shown, type(value).__name__, self.tracker, self.accepts, key)
