"""Which ``checkpoint-N`` the Trainer resumes from, and what it may remove (never what impel did not write).

impel marks its own Trainer saves twice: ``impel_saving.json`` is written into ``checkpoint-N`` before transformers
writes anything there (:meth:`impel.trainer.hf.Trainer._save_checkpoint`), and ``impel_complete.json`` (every file
and its size) replaces it once every rank has saved (:class:`impel.trainer.hf_callbacks.CompleteCheckpoints`). A
folder is then one of:

- ``complete``: impel's complete marker, every listed file at its size: resumable;
- ``cut short``: impel's saving marker without the complete one: impel's own save died midway: the only kind
  ``"auto"`` removes (it writes those steps again);
- ``changed``: impel's complete marker, but a file is gone or has another size (a user's edit, a copy cut short):
  not proof of a crash, so it is neither removed nor skipped: the resume refuses, naming the files;
- ``foreign``: no impel marker, ``trainer_state.json`` readable (transformers' own Trainer wrote it, or an earlier
  impel): adopted, with a line saying its files are not verified;
- ``unfinished``: no impel marker and no readable ``trainer_state.json`` (transformers writes it last): skipped
  with a line, left as it is.

``train(resume_from_checkpoint="auto")`` takes the newest resumable folder (from scratch when there is none);
``True`` takes the same and raises when there is none. A folder given by path is checked too: an
``Accelerator.save_state`` / Accelerate checkpoint (no ``trainer_state.json``), a changed file, or a damaged
``model.safetensors`` header raise naming what is wrong, before transformers reads anything.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from impel.config.run_config import ConfigError

logger = logging.getLogger("impel")

MARKER = "impel_complete.json"
SAVING = "impel_saving.json"
AUTO = "auto"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# files only Accelerator.save_state (impel's or Accelerate's) writes into a checkpoint folder
_SAVE_STATE_FILES = ("impel_checkpoint.json", "COMPLETE", "random_states_0.pkl", "random_states_0.pt",
                     "training_state.pt")


def sizes(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` and its size, impel's markers and temporary files left out."""
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name not in (MARKER, SAVING) and not p.name.endswith(".tmp")}


def changed_files(directory: str | os.PathLike[str]) -> list[str] | None:
    """The files of a marked checkpoint that are gone or have another size ([] when all match); None without a
    readable complete marker."""
    path = Path(directory)
    try:
        recorded = json.loads((path / MARKER).read_text(encoding="utf-8"))["files"]
        items = list(recorded.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return [name for name, size in items if not (path / name).is_file() or (path / name).stat().st_size != size]


def is_complete(directory: str | os.PathLike[str]) -> bool:
    """The checkpoint's complete marker exists and every file it lists has its recorded size."""
    return changed_files(directory) == []


def classify(directory: Path) -> str:
    """``complete``, ``cut short``, ``changed``, ``foreign`` or ``unfinished`` (see the module docstring)."""
    changed = changed_files(directory)
    if changed == []:
        return "complete"
    if (directory / SAVING).exists():
        return "cut short"
    if changed is not None:
        return "changed"
    try:
        json.loads((directory / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unfinished"
    return "foreign"


def checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N`` directory, newest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return sorted(found, reverse=True)


def newest_complete_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` that :func:`is_complete`; None when there is none."""
    return next((str(path) for _, path in checkpoints(output_dir) if is_complete(path)), None)


def _refuse_changed(path: Path) -> None:
    raise ConfigError(f"{path} was saved complete by impel but these files changed since: "
                      f"{', '.join(changed_files(path) or [])}; impel neither removes nor skips it. Restore them, "
                      f"move the folder out of the output_dir to resume from an older checkpoint, or pass "
                      f"resume_from_checkpoint={str(path)!r} after deleting {path / MARKER} to resume from it as it is")


def resolve_resume(resume_from_checkpoint: str | os.PathLike[str] | bool | None, output_dir: str,
                   main_process: bool) -> str | os.PathLike[str] | bool | None:
    """What transformers' ``train()`` gets for ``"auto"`` / True / a path (see the module docstring)."""
    if resume_from_checkpoint is not True and resume_from_checkpoint != AUTO:
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            check_given(Path(resume_from_checkpoint))
        return resume_from_checkpoint
    for _, path in checkpoints(output_dir):
        kind = classify(path)
        if kind == "changed":
            _refuse_changed(path)
        if kind in ("complete", "foreign"):
            if main_process:
                unverified = "" if kind == "complete" else (" (no impel marker: written by transformers' Trainer "
                                                            "or an earlier impel; its files are not verified)")
                print(f"impel: resuming from {path}{unverified}", flush=True)
            return str(path)
        if main_process and kind == "cut short":
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("impel: removed %s, impel's own save of it was cut short (%s without %s)", path, SAVING,
                           MARKER)
        elif main_process:
            logger.warning("impel: skipped %s: no impel marker and no readable %s (a save cut short, or not a "
                           "Trainer checkpoint); left as it is", path, TRAINER_STATE)
    if resume_from_checkpoint is True:
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): no checkpoint-N there is "
                         f"complete ({MARKER}) or has a readable {TRAINER_STATE}; pass a checkpoint's path, or "
                         "resume_from_checkpoint='auto' to start from scratch when there is none")
    return None


def check_given(path: Path) -> None:
    """A folder given as ``resume_from_checkpoint``: refuse what transformers would fail on with a raw error."""
    if not path.is_dir():
        return  # transformers names a missing folder itself
    if not (path / TRAINER_STATE).exists() and any((path / name).exists() for name in _SAVE_STATE_FILES):
        raise ConfigError(f"{path} is an Accelerator.save_state checkpoint (impel's or Accelerate's), not a Trainer "
                          f"checkpoint-N folder (it has no {TRAINER_STATE}); the Trainer resumes from its own "
                          "checkpoint-N folders: pass one of those, or load this one with accelerator.load_state("
                          f"{str(path)!r}) in a custom training loop")
    if changed_files(path):
        _refuse_changed(path)
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(weights)


def _check_safetensors(weights: Path) -> None:
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - transformers requires safetensors
        return
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        raise ConfigError(f"{weights} is damaged ({exc}; {weights.stat().st_size} bytes): it cannot be resumed "
                          "from; resume from another checkpoint, or restore the file") from None
