"""The progress display (a tqdm bar on the main process, or one line per log) and the end-of-run summary.

Example::

    print(format_logs({"loss": 0.4123, "learning_rate": 2e-5}))   # loss=0.4123 learning_rate=2.00e-05
"""
from __future__ import annotations

import sys
import time
from typing import Any

from impel.trainer.callbacks import TrainerCallback
from impel.trainer.state import TrainerControl, TrainerState


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


def last_eval(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest evaluation's metrics in the log history (without the wall-clock ones)."""
    for row in reversed(log_history):
        if any(k.startswith("eval_") for k in row):
            return {k: v for k, v in row.items() if k.startswith("eval_") and not k.endswith(("_runtime",
                                                                                               "_per_second"))}
    return {}


def format_summary(state: TrainerState, accelerator: Any, metrics: dict[str, float], metrics_path: str,
                   plot_path: str | None) -> str:
    """The end-of-run summary the main process prints."""
    evals = last_eval(state.log_history)
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
    if state.best_model_checkpoint:
        files.append(f"best checkpoint ({state.best_metric:.4g}): {state.best_model_checkpoint}")
    lines.append("  " + " | ".join(files))
    return "\n".join(lines)
