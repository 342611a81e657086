"""Callbacks: hooks into the Trainer's loop, and the progress display (a tqdm bar on the main process).

A callback subclasses :class:`TrainerCallback` and overrides the events it needs; each gets
``(args, state, control, **kwargs)`` as in transformers (kwargs: ``model``, ``optimizer``, ``lr_scheduler``,
``train_dataloader``, ``eval_dataloader``, and ``logs`` / ``metrics`` where they apply). Callbacks run on every
rank; whatever they decide in ``control`` must be the same on every rank.

Example::

    class StopAtLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and logs.get("loss", 1.0) < 0.1:
                control.should_training_stop = True
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

from .state import TrainerControl, TrainerState

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_step_end", "on_evaluate", "on_save", "on_log")


class TrainerCallback:
    """Base class: every event is a no-op; override the ones you need (see the module docstring)."""

    def on_init_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_epoch_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_epoch_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...
    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None: ...


class CallbackHandler:
    """Calls every callback for an event, in order; accepts classes (instantiated) and instances."""

    def __init__(self, callbacks: Iterable[Any]) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks:
            self.add(cb)

    def add(self, callback: Any) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if not any(callable(getattr(cb, event, None)) for event in EVENTS):
            raise TypeError(f"callbacks got {cb!r}, which has none of the TrainerCallback events; subclass "
                            "impel.TrainerCallback")
        self.callbacks.append(cb)

    def pop(self, callback: Any) -> Any:
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def call(self, event: str, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is not None:
                method(args, state, control, **kwargs)


def format_logs(logs: dict[str, Any]) -> str:
    """``key=value`` pairs, floats shortened: ``loss=0.4123 learning_rate=2.0e-05``."""
    parts = []
    for key, value in logs.items():
        if isinstance(value, float):
            text = f"{value:.2e}" if (value != 0 and abs(value) < 1e-3) else f"{value:.4g}"
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class ProgressCallback(TrainerCallback):
    """A tqdm bar on the main process (loss, lr, samples/s; tqdm shows the ETA), or, with ``disable_tqdm=True``,
    one printed line per log. Evaluation results are printed as a line either way."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.started = 0.0
        self.start_samples = 0
        self.postfix: dict[str, str] = {}

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.started, self.start_samples = time.perf_counter(), state.samples_seen
        if state.is_world_process_zero and not args.disable_tqdm:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def samples_per_second(self, state: TrainerState) -> float:
        elapsed = time.perf_counter() - self.started
        return (state.samples_seen - self.start_samples) / elapsed if elapsed > 0 else 0.0

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.bar is not None:
            self.postfix["samples/s"] = f"{self.samples_per_second(state):.1f}"
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        if self.bar is not None:
            if "loss" in logs:
                self.postfix["loss"] = f"{logs['loss']:.4f}"
            if "learning_rate" in logs:
                self.postfix["lr"] = f"{logs['learning_rate']:.2e}"
            self.bar.set_postfix(self.postfix, refresh=True)
            if any(k.startswith("eval_") for k in logs):
                self.bar.write(format_logs(logs), file=sys.stderr)
        else:
            print(format_logs(logs), flush=True)

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_summary(state: TrainerState, accelerator: Any, metrics: dict[str, float], evals: dict[str, Any],
                   metrics_path: str, plot_path: str | None) -> str:
    """The end-of-run summary the main process prints."""
    lines = [(f"impel Trainer: {state.global_step}/{state.max_steps} optimizer steps, epoch {state.epoch:.2f}, "
              f"{accelerator.num_processes} process(es) ({accelerator.distributed_type}), mixed precision "
              f"{accelerator.mixed_precision}, global batch {state.train_batch_size}"),
             (f"  time {metrics['train_runtime']:.1f} s, {metrics['train_samples_per_second']:.1f} samples/s, "
              f"mean logged train loss {metrics['train_loss']:.4f}")]
    if evals:
        lines.append("  last evaluation: " + format_logs(evals))
    files = [f"metrics: {metrics_path}"]
    if plot_path:
        files.append(f"loss plot: {plot_path}")
    if state.last_checkpoint:
        files.append(f"last checkpoint: {state.last_checkpoint}")
    lines.append("  " + " | ".join(files))
    return "\n".join(lines)
