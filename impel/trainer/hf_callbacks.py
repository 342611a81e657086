"""impel's additions to transformers' Trainer, as ``TrainerCallback`` objects (they change no number).

:class:`impel.trainer.hf.Trainer` adds both callbacks to every run:

- :class:`RunRecord`: on the main process, ``output_dir/metrics.jsonl`` (every log and evaluation row of
  ``state.log_history``, each with its ``step``; what ``impel compare`` reads) is rewritten at each log, and
  ``output_dir/loss.png`` (train and eval loss against the optimizer step) is drawn at the end of training
  (``Trainer(plot_loss=None)``: when matplotlib is installed, else a line says how to get it; True requires it;
  False skips the plot).
- :class:`CompleteCheckpoints`: after every rank has written a checkpoint, the main process writes
  ``checkpoint-N/impel_complete.json`` (every file's size), by a rename, so it appears whole or not at all. A
  checkpoint without it, or whose files no longer have those sizes, was cut short (a crash mid-save) and
  :func:`newest_complete_checkpoint` never returns it.

Auto-resume: ``trainer.train(resume_from_checkpoint="auto")`` (or ``TrainingArguments(resume_from_checkpoint=
"auto")`` passed on as transformers' examples do) resumes from the newest complete checkpoint in ``output_dir``
and starts from scratch when there is none; the incomplete checkpoints newer than it are removed first (the run
writes those steps again). ``resume_from_checkpoint=True`` keeps transformers' meaning (raise when there is no
checkpoint) but also takes the newest *complete* one.

Example::

    trainer = Trainer(model=model, args=args, train_dataset=train, plot_loss=False)
    trainer.train(resume_from_checkpoint="auto")   # the same command after a crash continues where it stopped
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from impel.trainer.plot import series, write_loss_plot

logger = logging.getLogger("impel")

MARKER = "impel_complete.json"
METRICS = "metrics.jsonl"
PLOT = "loss.png"
AUTO = "auto"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunRecord(TrainerCallback):
    """``metrics.jsonl`` at each log, ``loss.png`` at the end (main process only)."""

    def __init__(self, plot_loss: bool | None = None) -> None:
        self.plot_loss = plot_loss

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            rows = "".join(json.dumps(row) + "\n" for row in state.log_history)
            os.makedirs(args.output_dir, exist_ok=True)
            _write_atomically(Path(args.output_dir) / METRICS, rows)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.plot_loss is None and not any(series(state.log_history, key)[0] for key in ("loss", "eval_loss")):
            print("impel: no loss plot written (nothing was logged: logging_steps > the steps run)", flush=True)
            return
        write_loss_plot(state.log_history, Path(args.output_dir) / PLOT, self.plot_loss)


class CompleteCheckpoints(TrainerCallback):
    """Marks a checkpoint complete once every rank has written it (``accelerator.wait_for_everyone()``)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.accelerator.wait_for_everyone()  # DeepSpeed / sharded FSDP checkpoints: every rank writes files
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and directory.is_dir():
            _write_atomically(directory / MARKER, json.dumps({"global_step": state.global_step,
                                                              "files": _sizes(directory)}, indent=1))
        self.accelerator.wait_for_everyone()


def _sizes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")}


def is_complete(directory: str | os.PathLike[str]) -> bool:
    """The checkpoint's marker exists and every file it lists has its recorded size."""
    path = Path(directory)
    try:
        recorded = json.loads((path / MARKER).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in recorded.items())


def _checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N`` directory, newest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return sorted(found, reverse=True)


def newest_complete_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` that :func:`is_complete`; None when there is none."""
    return next((str(path) for _, path in _checkpoints(output_dir) if is_complete(path)), None)


def remove_incomplete_after(output_dir: str | os.PathLike[str], step: int) -> list[str]:
    """Delete the incomplete ``checkpoint-N`` with N > ``step`` (a crash cut their save short); returns them."""
    removed = []
    for n, path in _checkpoints(output_dir):
        if n > step and not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def resolve_resume(resume_from_checkpoint: Any, output_dir: str, main_process: bool) -> Any:
    """What transformers' ``train()`` gets for ``"auto"`` / True (see the module docstring); other values as
    given."""
    if resume_from_checkpoint is not True and resume_from_checkpoint != AUTO:
        return resume_from_checkpoint
    newest = newest_complete_checkpoint(output_dir)
    if newest is None and resume_from_checkpoint is True:
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): no checkpoint-N there "
                         f"has impel's {MARKER} (a checkpoint cut short by a crash has none); pass a checkpoint's "
                         "path, or resume_from_checkpoint='auto' to start from scratch when there is none")
    step = -1 if newest is None else int(_CHECKPOINT.match(Path(newest).name).group(1))  # type: ignore[union-attr]
    if main_process:
        for path in remove_incomplete_after(output_dir, step):
            logger.warning("impel: removed %s, a checkpoint whose save did not complete", path)
    if newest is not None and main_process:
        print(f"impel: resuming from {newest}", flush=True)
    return newest
