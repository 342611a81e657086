"""impel's additions to transformers' Trainer, as ``TrainerCallback`` objects (they change no number).

:class:`impel.trainer.hf.Trainer` adds both callbacks to every run:

- :class:`MetricsLog`: on the main process, ``output_dir/metrics.jsonl`` (every log and evaluation row of
  ``state.log_history``, each with its ``step``; what ``impel compare`` reads) is rewritten at each log, and
  ``output_dir/loss.png`` (train and eval loss against the optimizer step) is drawn at the end of training
  (``Trainer(plot_loss=None)``: when matplotlib is installed, else a line says how to get it; True requires it;
  False skips the plot).
- :class:`CompleteCheckpoints`: after every rank has written a checkpoint, the main process writes
  ``checkpoint-N/impel_complete.json`` (every file's size), by a rename, so it appears whole or not at all, and
  removes the ``impel_saving.json`` the save began with. What a resume makes of the markers (and of checkpoints
  without them): :mod:`impel.trainer.hf_resume`.

Example::

    trainer = Trainer(model=model, args=args, train_dataset=train, plot_loss=False)
    trainer.train(resume_from_checkpoint="auto")   # the same command after a crash continues where it stopped
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainerCallback

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from impel.accelerator.facade import Accelerator

from impel.trainer.hf_resume import MARKER, SAVING, sizes
from impel.trainer.plot import series, write_loss_plot

logger = logging.getLogger("impel")

METRICS = "metrics.jsonl"
PLOT = "loss.png"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLog(TrainerCallback):
    """``metrics.jsonl`` at each log, ``loss.png`` at the end (main process only)."""

    def __init__(self, plot_loss: bool | None = None) -> None:
        self.plot_loss = plot_loss

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Mapping[str, object] | None = None, **kwargs: object) -> None:
        if state.is_world_process_zero:
            rows = "".join(json.dumps(row) + "\n" for row in state.log_history)
            os.makedirs(args.output_dir, exist_ok=True)
            _write_atomically(Path(args.output_dir) / METRICS, rows)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: object) -> None:
        if not state.is_world_process_zero:
            return
        if self.plot_loss is None and not any(series(state.log_history, key)[0] for key in ("loss", "eval_loss")):
            print("impel: no loss plot written (nothing was logged: logging_steps > the steps run)", flush=True)
            return
        write_loss_plot(state.log_history, Path(args.output_dir) / PLOT, self.plot_loss)


class CompleteCheckpoints(TrainerCallback):
    """Marks a checkpoint complete once every rank has written it (``accelerator.wait_for_everyone()``)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object) -> None:
        self.accelerator.wait_for_everyone()  # DeepSpeed / sharded FSDP checkpoints: every rank writes files
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and directory.is_dir():
            _write_atomically(directory / MARKER, json.dumps({"global_step": state.global_step,
                                                              "files": sizes(directory)}, indent=1))
            (directory / SAVING).unlink(missing_ok=True)
        self.accelerator.wait_for_everyone()
