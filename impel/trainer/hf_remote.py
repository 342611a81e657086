"""The Trainer's ``output_dir`` on object storage (``s3://``, ``gs://``, ``memory://``, any fsspec URL).

transformers' Trainer writes with local file operations (a URL would become a local folder named ``s3:``), so impel
mirrors: the Trainer writes into a local staging directory (``$IMPEL_STAGING_DIR``, else the system's temporary
directory; ``trainer.args.output_dir`` names it, ``trainer.output_url`` the URL) and the main process uploads:

- each ``checkpoint-N`` once every rank has saved it and impel has marked it complete: every file, then
  ``impel_complete.json`` **last**, so a prefix without it (an upload cut short) is never resumed;
- rotation with ``save_total_limit``: the oldest remote checkpoints that carry impel's marker go (the best one,
  ``load_best_model_at_end``, is kept, as transformers keeps it), marker first; a prefix without impel's marker is
  never deleted;
- the other files of ``output_dir`` (``metrics.jsonl``, ``loss.png``, logs, what ``save_model()`` writes) at each
  checkpoint, at the end of training and after ``save_model()``, each file again only when it changed.

``train(resume_from_checkpoint="auto")`` (or True) takes the newest remote checkpoint with impel's marker: it is
downloaded into the staging directory (by one rank per machine) and checked like a local one
(:mod:`impel.trainer.hf_resume`); a ``checkpoint-N`` URL is downloaded the same way.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainerCallback

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from impel.accelerator.facade import Accelerator
    from impel.checkpoint.store.remote import Remote

from impel.config.run_config import ConfigError
from impel.trainer import hf_resume

logger = logging.getLogger("impel")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class RemoteOutput:
    """An ``output_dir`` URL and its local staging directory."""

    def __init__(self, url: str) -> None:
        from impel.checkpoint.store import remote

        root = remote.parse(url, "TrainingArguments(output_dir=...)")
        assert root is not None  # the caller checked the scheme
        self.root = root
        self.local = remote.staging_path(root)
        self.local.mkdir(mode=0o700, exist_ok=True)
        self.sent: dict[str, tuple[int, int]] = {}  # output_dir files uploaded: (size, mtime_ns) when sent

    @property
    def url(self) -> str:
        return self.root.url

    # --- upload -----------------------------------------------------------------------------------------------
    def upload_checkpoint(self, name: str) -> bool:
        """Upload ``checkpoint-N`` when impel marked it complete, its marker last; False when it is not."""
        from impel.checkpoint.store import remote

        folder = self.local / name
        if not hf_resume.is_complete(folder):
            return False
        remote.put_tree(folder, self.root.child(name), hf_resume.MARKER)
        return True

    def upload_outputs(self) -> None:
        """The files of ``output_dir`` outside its checkpoints, each one again only when it changed."""
        for path in sorted(self.local.rglob("*")):
            rel = path.relative_to(self.local)
            if not path.is_file() or _CHECKPOINT.match(rel.parts[0]) or path.name.endswith(".tmp"):
                continue
            info = path.stat()
            seen = (info.st_size, info.st_mtime_ns)
            if self.sent.get(rel.as_posix()) != seen:
                self.root.fs.put_file(str(path), f"{self.url}/{rel.as_posix()}")
                self.sent[rel.as_posix()] = seen

    # --- listing and rotation --------------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, str]]:
        """Remote ``checkpoint-N`` prefixes that hold impel's complete marker, oldest first."""
        try:
            entries = self.root.fs.ls(self.url, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            match = _CHECKPOINT.match(name)
            if match and self.root.fs.exists(f"{self.url}/{name}/{hf_resume.MARKER}"):
                found.append((int(match.group(1)), name))
        return sorted(found)

    def rotate(self, limit: int | None, best: str | None) -> list[str]:
        """Remove the oldest marked remote checkpoints beyond ``limit`` (keeping ``best``); their names."""
        if limit is None:
            return []
        names = [name for _, name in self.complete()]
        keep = set(names[len(names) - limit:] if limit > 0 else []) | ({Path(best).name} if best else set())
        doomed = [name for name in names if name not in keep]
        for name in doomed:
            self._remove(name)
        return doomed

    def _remove(self, name: str) -> None:
        """The marker first (the prefix is then never resumed), then the files it lists; nothing else."""
        target = f"{self.url}/{name}"
        with self.root.fs.open(f"{target}/{hf_resume.MARKER}", "rb") as handle:
            listed = json.loads(handle.read()).get("files", {})
        self.root.fs.rm_file(f"{target}/{hf_resume.MARKER}")
        for rel in listed:
            if isinstance(rel, str) and ".." not in Path(rel).parts and not os.path.isabs(rel):
                try:
                    self.root.fs.rm_file(f"{target}/{rel}")
                except FileNotFoundError:
                    pass

    # --- resume ----------------------------------------------------------------------------------------------
    def fetch(self, resume: str | os.PathLike[str] | bool | None,
              accelerator: Accelerator) -> str | os.PathLike[str] | bool | None:
        """``resume_from_checkpoint`` made local: "auto" / True the newest marked remote checkpoint (None for "auto"
        without one; True raises), a ``checkpoint-N`` URL that one; downloaded by one rank per machine."""
        from impel.checkpoint.store import remote

        if resume is True or resume == hf_resume.AUTO:
            found = self.complete()
            if not found:
                if resume is True:
                    raise ValueError(f"No valid checkpoint found in output_dir ({self.url}): no checkpoint-N there "
                                     f"holds impel's {hf_resume.MARKER}; use resume_from_checkpoint='auto' to start "
                                     "from scratch when there is none")
                return None
            name = found[-1][1]
            source = self.root.child(name)
        elif remote.scheme_of(resume) is not None:
            given = remote.parse(resume, "resume_from_checkpoint")
            assert given is not None
            source, name = given, given.name
            if not source.fs.exists(f"{source.url}/{hf_resume.MARKER}"):
                raise ConfigError(f"resume_from_checkpoint={resume!r} holds no {hf_resume.MARKER}: not a checkpoint "
                                  "impel's Trainer uploaded complete (an upload cut short, or another tool's); pass "
                                  "a complete one")
        else:
            return resume
        local = self.local / name
        if accelerator.is_local_main_process and not _same_marker(source, local):
            shutil.rmtree(local, ignore_errors=True)
            remote.get_tree(source, local, hf_resume.MARKER)
        accelerator.wait_for_everyone()
        logger.info("impel: resuming from %s (downloaded to %s)", source.url, local)
        return str(local)


def _same_marker(source: Remote, local: Path) -> bool:
    """The local copy is already this remote checkpoint, whole (a resume on the machine that saved it)."""
    try:
        with source.fs.open(f"{source.url}/{hf_resume.MARKER}", "rb") as handle:
            theirs = json.loads(handle.read())
        return json.loads((local / hf_resume.MARKER).read_text(encoding="utf-8")) == theirs \
            and hf_resume.is_complete(local)
    except (OSError, ValueError):
        return False


class UploadOutput(TrainerCallback):
    """After impel marked a checkpoint complete (added after :class:`~impel.trainer.hf_callbacks.CompleteCheckpoints`):
    upload it, rotate the remote ones, upload the other outputs; at the end of training the outputs again."""

    def __init__(self, out: RemoteOutput) -> None:
        self.out = out

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object) -> None:
        if state.is_world_process_zero:
            self.out.upload_checkpoint(f"checkpoint-{state.global_step}")
            self.out.rotate(args.save_total_limit, state.best_model_checkpoint)
            self.out.upload_outputs()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: object) -> None:
        if state.is_world_process_zero:
            self.out.upload_outputs()


def mirror(args: TrainingArguments) -> RemoteOutput | None:
    """For an ``output_dir`` URL: its mirror, with ``args.output_dir`` set to the local staging directory."""
    from impel.checkpoint.store import remote

    if remote.scheme_of(getattr(args, "output_dir", None)) is None:
        return None
    out = RemoteOutput(str(args.output_dir))
    args.output_dir = str(out.local)
    return out
