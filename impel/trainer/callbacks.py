"""Callbacks: hooks into the Trainer's loop (transformers' events and semantics), and early stopping. The progress
display is a callback too (:mod:`impel.trainer.progress`).

A callback subclasses :class:`TrainerCallback` (impel's or transformers' own) and overrides the events it needs;
each gets ``(args, state, control, **kwargs)`` as in transformers (kwargs: ``model``, ``processing_class``,
``optimizer``, ``lr_scheduler``, ``train_dataloader``, ``eval_dataloader``, and ``logs`` / ``metrics`` where they
apply). An event may return a control object, which replaces ``control`` (transformers' rule). Callbacks run on
every rank; whatever they decide in ``control`` must be the same on every rank.

Example::

    class StopAtLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and logs.get("loss", 1.0) < 0.1:
                control.should_training_stop = True
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from impel.config.run_config import ConfigError
from impel.trainer.state import TrainerControl, TrainerState

logger = logging.getLogger("impel")

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict",
          "on_save", "on_log", "on_prediction_step", "on_push_begin")
# what the handler clears before an event's callbacks run, as transformers' CallbackHandler does
_CLEARS = {"on_train_begin": ("should_training_stop",), "on_epoch_begin": ("should_epoch_stop",),
           "on_step_begin": ("should_log", "should_evaluate", "should_save"), "on_evaluate": ("should_evaluate",),
           "on_save": ("should_save",), "on_log": ("should_log",)}


class TrainerCallback:
    """Base class: every event is a no-op; override the ones you need (see the module docstring).
    ``on_push_begin`` exists for transformers' callbacks and is never called (impel does not push to the Hub)."""

    def on_init_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_epoch_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_epoch_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_pre_optimizer_step(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_optimizer_step(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_substep_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_predict(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_prediction_step(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...
    def on_push_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any: ...


class CallbackHandler:
    """Calls every callback for an event, in order; accepts classes (instantiated) and instances."""

    def __init__(self, callbacks: Iterable[Any]) -> None:
        self.callbacks: list[Any] = []
        for cb in callbacks:
            self.add(cb)

    def add(self, callback: Any) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if not any(callable(getattr(cb, event, None)) for event in EVENTS):
            raise TypeError(f"callbacks got {cb!r}, which has none of the TrainerCallback events; subclass "
                            "impel.TrainerCallback (or transformers.TrainerCallback)")
        if any(type(c) is type(cb) for c in self.callbacks):
            logger.warning("adding a second %s to the Trainer's callbacks (now: %s)", type(cb).__name__,
                           ", ".join(type(c).__name__ for c in self.callbacks))
        self.callbacks.append(cb)

    def pop(self, callback: Any) -> Any:
        for cb in self.callbacks:
            if (isinstance(callback, type) and isinstance(cb, callback)) or cb == callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove(self, callback: Any) -> None:
        if isinstance(callback, type):
            self.pop(callback)
        else:
            self.callbacks.remove(callback)

    def call(self, event: str, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> Any:
        """Run ``event`` on every callback; returns the control object (a callback may return a new one)."""
        for flag in _CLEARS.get(event, ()):
            setattr(control, flag, False)
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            result = method(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control


def export_states(callbacks: Iterable[Any]) -> dict[str, Any]:
    """``{class name: cb.state()}`` of callbacks with transformers' ``ExportableState.state()`` (saved with each
    checkpoint; several of one class become a list, as in transformers)."""
    out: dict[str, Any] = {}
    for cb in callbacks:
        if not callable(getattr(cb, "state", None)):
            continue
        name = type(cb).__name__
        if name not in out:
            out[name] = cb.state()
        else:
            out[name] = [*(out[name] if isinstance(out[name], list) else [out[name]]), cb.state()]
    return out


def restore_states(callbacks: Iterable[Any], saved: dict[str, Any]) -> None:
    """Set the saved ``attributes`` back on the callbacks of the same class, in order
    (``restore_callback_states_from_checkpoint=True``)."""
    callbacks = list(callbacks)
    for name, data in saved.items():
        same = [cb for cb in callbacks if type(cb).__name__ == name]
        if not same:
            logger.warning("the checkpoint holds the state of a %s, which this Trainer does not have; ignoring it",
                           name)
        for cb, entry in zip(same, data if isinstance(data, list) else [data]):
            for attribute, value in entry.get("attributes", {}).items():
                setattr(cb, attribute, value)


class EarlyStoppingCallback(TrainerCallback):
    """Stop training when ``metric_for_best_model`` has not improved (by more than ``early_stopping_threshold``)
    for ``early_stopping_patience`` evaluations in a row; transformers' semantics: it needs metric_for_best_model
    and an eval_strategy, and warns without load_best_model_at_end.

    Example::

        args = TrainingArguments(..., eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True)
        Trainer(model, args, ..., callbacks=[EarlyStoppingCallback(early_stopping_patience=3)])
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0) -> None:
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0  # evaluations in a row without improvement

    def check_metric_value(self, args: Any, state: TrainerState, control: TrainerControl, metric_value: float) -> None:
        best = state.best_metric  # the Trainer updates it after on_evaluate, so this is the best before this one
        if best is None:
            self.early_stopping_patience_counter = 0
            return
        better = metric_value > best if args.greater_is_better else metric_value < best
        if better and abs(metric_value - best) > (self.early_stopping_threshold or 0.0):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not args.load_best_model_at_end:
            logger.warning("Using EarlyStoppingCallback without load_best_model_at_end=True: once training is "
                           "finished, the best model will not be loaded automatically")
        if args.metric_for_best_model is None:
            raise ConfigError("EarlyStoppingCallback requires metric_for_best_model to be defined; set "
                              "TrainingArguments(metric_for_best_model='loss') or load_best_model_at_end=True")
        if args.eval_strategy == "no":
            raise ConfigError("EarlyStoppingCallback requires an eval_strategy of 'steps' or 'epoch', got 'no'")

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, float] | None = None, **kwargs: Any) -> None:
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        value = (metrics or {}).get(key)
        if value is None:
            logger.warning("early stopping requires metric_for_best_model, but %s is not among the evaluation "
                           "metrics, so early stopping is disabled", key)
            return
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict[str, Any]:
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter}}
