"""Where checkpoints live and how one becomes visible: naming, atomic commit, manifest, verification, rotation.

A checkpoint is written into a hidden temporary directory next to its final name (``.impel-tmp-<name>-<token>``).
When every rank has written and fsynced its files, the committing rank writes ``impel_checkpoint.json`` (step,
world size, strategy, versions and a manifest of every file with its size and the XXH3-128 of each 64 MiB block),
then the completion marker ``COMPLETE`` (holding the sha256 of that JSON), fsyncs, and renames the directory into
place. A directory without the marker is never loaded; leftover temporary directories are deleted by the next save
or load.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from impel.checkpoint.errors import CheckpointError
from impel.checkpoint.io import hashing
from impel.checkpoint.store import tempdirs

logger = logging.getLogger("impel")

CHECKPOINTS_DIR = "checkpoints"
METADATA_FILE = "impel_checkpoint.json"
MARKER_FILE = "COMPLETE"
TMP_PREFIX = ".impel-tmp-"
OLD_PREFIX = ".impel-old-"
# 4: a file may list where its blocks end (ENDS_KEY: one block per run of a file several ranks wrote); 3: XXH3-128
# per 64 MiB block (hashing.py); 2: sha256 per block; 1: sha256 per file (all load)
FORMAT_VERSION = 4
ENDS_KEY = "block_ends"
_NAME = re.compile(r"^checkpoint_(\d+)$")
_WARNED: set[str] = set()


# --- naming ---------------------------------------------------------------------------------------------------
def checkpoint_name(iteration: int) -> str:
    """``checkpoint_<iteration>``, the automatic name Accelerate uses too."""
    return f"checkpoint_{iteration}"


def parse_iteration(name: str) -> int | None:
    """The N of ``checkpoint_N``, or None for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def is_complete(directory: Path) -> bool:
    """True when ``directory`` carries the completion marker and its metadata."""
    return (directory / MARKER_FILE).is_file() and (directory / METADATA_FILE).is_file()


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """Complete ``checkpoint_N`` directories under ``root``, oldest (smallest N) first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        number = parse_iteration(entry.name)
        if number is None or not entry.is_dir():
            continue
        if is_complete(entry):
            found.append((number, entry))
        elif not is_accelerate_dir(entry) and str(entry) not in _WARNED:  # Accelerate's: accelerate_format
            _WARNED.add(str(entry))  # once per directory and process
            # without the metadata too, nothing of a checkpoint is left: the user's files that rotation kept
            log = logger.warning if (entry / METADATA_FILE).exists() else logger.info
            log("ignoring %s: it has no %s marker (not an impel checkpoint, or an interrupted copy)", entry,
                MARKER_FILE)
    return sorted(found)


# a file only Accelerate's save_state writes (its directories are loaded by accelerate_format)
_ACCELERATE_SIGNATURE = re.compile(
    r"^(random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|scaler\.pt|latest"
    r"|(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin|optimizer_\d+(_rank\d+\.bin)?"
    r"|pytorch_model_fsdp(_\d+)?(_rank\d+)?(\.bin)?|latest_checkpointed_iteration\.txt)$")


def is_accelerate_dir(directory: Path) -> bool:
    """True for a directory without impel's marker that holds a file only Accelerate's ``save_state`` writes."""
    if not directory.is_dir() or is_complete(directory):
        return False
    return any(_ACCELERATE_SIGNATURE.match(entry.name) for entry in directory.iterdir())


def latest_complete(root: Path) -> Path:
    """The newest complete checkpoint under ``root``; a CheckpointError when there is none."""
    found = list_complete(root)
    if not found:
        raise CheckpointError(f"no complete checkpoint (checkpoint_N with a {MARKER_FILE} marker) in {root}; "
                              "call save_state() first, or pass load_state(input_dir=...) explicitly")
    return found[-1][1]


def next_free_iteration(root: Path) -> int:
    """One more than the highest ``checkpoint_N`` under ``root`` (complete or not), or 0."""
    numbers = [parse_iteration(e.name) for e in root.iterdir()] if root.is_dir() else []
    return max((n for n in numbers if n is not None), default=-1) + 1


# --- temporary directories and cleanup ---------------------------------------------------------------------------
def temp_dir_for(final: Path, token: str | None = None) -> Path:
    """The hidden sibling directory a save of ``final`` is written into before the rename."""
    return final.parent / f"{TMP_PREFIX}{final.name}-{token or secrets.token_hex(12)}"


def clean_incomplete(root: Path, keep: Path | None = None) -> list[Path]:
    """Delete the temporary and swapped-out directories interrupted saves left in ``root``, but only those provably
    dead (:mod:`impel.checkpoint.store.tempdirs`): another job's save in flight there is left alone. ``keep``: the
    temporary directory of the save that is cleaning, already in use."""
    return tempdirs.clean(root, keep, (TMP_PREFIX, OLD_PREFIX))


def recover_swap(final: Path) -> None:
    """If a crash hit between the two renames that replace ``final``, put the previous complete copy back."""
    if final.exists() or not final.parent.is_dir():
        return
    for entry in sorted(final.parent.glob(f"{OLD_PREFIX}{final.name}-*")):
        if is_complete(entry):
            logger.warning("restoring %s from %s (a save that replaced it was interrupted)", final, entry)
            os.replace(entry, final)
            fsync_dir(final.parent)
            return


def rotate(root: Path, total_limit: int | None, remove: Callable[[Path, str], object]) -> list[Path]:
    """Remove the oldest complete checkpoints so that at most ``total_limit`` remain, each with
    ``remove(path, why)`` (``ownership.remove_checkpoint``: the user's files in it stay)."""
    if total_limit is None:
        return []
    found = list_complete(root)
    doomed = [path for _, path in found[: max(0, len(found) - total_limit)]]
    for path in doomed:
        remove(path, f"total_limit={total_limit}")
    return doomed


def check_target(final: Path) -> None:
    """Refuse to replace a non-empty directory that is not an impel checkpoint (it may hold the user's files)."""
    if final.is_file():
        raise CheckpointError(f"save_state output_dir {final} is a file; pass a directory path")
    if final.is_dir() and any(final.iterdir()) and not is_complete(final):
        raise CheckpointError(f"save_state output_dir {final} exists and is not an impel checkpoint; impel replaces "
                              "a checkpoint directory as a whole, so pass a new or empty directory")


# --- durability ------------------------------------------------------------------------------------------------
def fsync_file(path: Path) -> None:
    """Flush a written file to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- manifest ----------------------------------------------------------------------------------------------------
def manifest_entry(size: int, blocks: list[str], ends: list[int] | None = None) -> dict[str, Any]:
    """A file's manifest entry; ``ends``: where its blocks end when they are not of the manifest's block size (a
    file several ranks wrote, one block per run: format version 4)."""
    entry: dict[str, Any] = {"size": size, hashing.WRITTEN_KEY: blocks}
    if ends is not None:
        entry[ENDS_KEY] = ends
    return entry


def entry_ends(entry: dict[str, Any]) -> list[int] | None:
    """Where a manifest entry's blocks end, when it lists that (else blocks of the manifest's block size)."""
    ends = entry.get(ENDS_KEY)
    return [int(e) for e in ends] if ends is not None else None


def entry_blocks(entry: dict[str, Any]) -> tuple[str, list[str]] | None:
    """A manifest entry's (key, block digests): ``xxh3_128_blocks`` (format 3) or ``sha256_blocks`` (format 2);
    None for a format version 1 entry (one ``sha256`` of the whole file)."""
    for key in hashing.KEYS:
        if key in entry:
            return key, list(entry[key])
    return None


def corrupted(path: Path, entry: dict[str, Any], bad: int, block: int) -> CheckpointError:
    """The error for a block whose digest differs from the manifest's: it names the file and the byte range."""
    found = entry_blocks(entry)
    assert found is not None
    key, blocks = found
    lo, hi = hashing.block_range(bad, entry["size"], block, entry_ends(entry))
    want = blocks[bad][:12] if bad < len(blocks) else "(none)"
    return CheckpointError(f"checkpoint file {path} is corrupted (bytes {lo}-{hi} differ from the manifest's "
                           f"{key.removesuffix('_blocks')} {want}...); load an earlier checkpoint or save again")


def missing_file(path: Path) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete: copy it again or load "
                           "an earlier checkpoint")


def wrong_size(path: Path, size: int, entry: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is truncated or corrupted ({size} bytes, the manifest says "
                           f"{entry['size']} bytes); load an earlier checkpoint or save again")


def build_manifest(directory: Path, known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every file under ``directory`` (relative posix path) with its size and block digests, marker and metadata
    excluded.

    ``known``: digests computed while the files were written; an entry whose size still matches is taken as is,
    everything else is hashed here.
    """
    known = known or {}
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file()
             and p.relative_to(directory).as_posix() not in (METADATA_FILE, MARKER_FILE)]
    entries: dict[str, dict[str, Any]] = {}
    missing: list[Path] = []
    for path in paths:
        rel, size = path.relative_to(directory).as_posix(), path.stat().st_size
        entry = known.get(rel)
        if entry is not None and entry["size"] == size:
            entries[rel] = manifest_entry(size, entry[hashing.WRITTEN_KEY], entry_ends(entry))
        else:
            missing.append(path)
    for path, blocks in zip(missing, hashing.file_digests(missing)):
        entries[path.relative_to(directory).as_posix()] = manifest_entry(path.stat().st_size, blocks)
    return {rel: entries[rel] for rel in sorted(entries)}


def commit(temp: Path, final: Path, metadata: Mapping[str, object], known: dict[str, dict[str, Any]] | None = None,
           keep: Callable[[Path, Path], object] | None = None) -> None:
    """Seal ``temp`` (manifest, metadata, marker, fsync) and rename it to ``final``, replacing an old checkpoint.

    ``known``: digests already computed (:func:`build_manifest`); their files are already fsynced too.
    ``keep(final, temp)``: called when ``final`` is a complete checkpoint, after ``temp`` is sealed and before the
    swap, to bring what must survive the replacement into ``temp`` (the user's files, :mod:`.ownership`).
    """
    tempdirs.release(temp)  # its lock file is no file of the checkpoint
    known = known or {}
    unsynced = [path for path in temp.rglob("*") if path.is_file() and path.relative_to(temp).as_posix() not in known]
    body = dict(metadata, format_version=FORMAT_VERSION, block_size=hashing.BLOCK, files=build_manifest(temp, known))
    text = json.dumps(body, indent=1, sort_keys=True)
    _write_text(temp / METADATA_FILE, text)
    _write_text(temp / MARKER_FILE, hashlib.sha256(text.encode()).hexdigest() + "\n")
    # every fsync after every write: the first one's journal commit carries them all, the rest find nothing to do
    # (one commit instead of one per file); nothing is visible before the rename below, after all of them
    for path in [*unsynced, temp / METADATA_FILE, temp / MARKER_FILE]:
        fsync_file(path)
    if keep is not None and is_complete(final):
        keep(final, temp)
    fsync_dir(temp)
    old = None
    if final.exists():
        old = final.parent / f"{OLD_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}"
        os.replace(final, old)
    os.replace(temp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    """Write ``path`` (not fsynced: :func:`commit` fsyncs it with the others)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_metadata(directory: Path) -> dict[str, Any]:
    """The parsed ``impel_checkpoint.json`` of a complete checkpoint (no file checks)."""
    if directory.is_file():
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory; pass the directory save_state() "
                              f"wrote (the one holding this file: {directory.parent})")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist; pass the path save_state() returned")
    if not is_complete(directory):
        raise CheckpointError(f"{directory} is not a complete impel checkpoint (no {MARKER_FILE} marker or no "
                              f"{METADATA_FILE}); it was interrupted while saving or not written by impel: load "
                              "an earlier checkpoint")
    path = directory / METADATA_FILE
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); the checkpoint is damaged: load an earlier one") from None
    marker = (directory / MARKER_FILE).read_text(encoding="utf-8").strip()
    if marker != hashlib.sha256(text.encode()).hexdigest():
        raise CheckpointError(f"{path} does not match its {MARKER_FILE} marker (edited or corrupted); load an "
                              "earlier checkpoint or save again")
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{path} has no file manifest; it was not written by this impel version")
    version = data.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {version!r}, which this impel does not read (it reads 1 "
                              f"to {FORMAT_VERSION}); upgrade impel to load checkpoints written by a newer one")
    for rel in data["files"]:
        _check_confined(directory, rel, path)
    return data


def _check_confined(directory: Path, rel: Any, manifest: Path) -> None:
    """A manifest names files inside its checkpoint only: relative, no ``..``, no absolute path, nothing that
    resolves outside it (a symlinked folder): rotation deletes what the manifest names."""
    parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
    inside = (bool(parts) and not PurePosixPath(rel).is_absolute() and "\\" not in rel
              and all(part not in ("..", ".", "") for part in parts))
    if inside:
        root = directory.resolve()
        inside = root in (directory / rel).resolve().parents
    if not inside:
        raise CheckpointError(f"{manifest} names {rel!r}, a path outside its checkpoint {directory} (absolute, with "
                              "'..', or through a link); impel reads, verifies and deletes only files inside a "
                              "checkpoint: this manifest was not written by impel as it is: load an earlier checkpoint")


def verify(directory: Path, checksums: bool = True, skip: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Check that every file of the manifest exists with its size, and (``checksums``) its block digests; return
    the metadata. ``skip(rel)``: files whose checksums are left to the reader (``verified``: checked while read)."""
    data = read_metadata(directory)
    files: dict[str, dict[str, Any]] = data["files"]
    for rel in files:
        if not (directory / rel).is_file():
            raise missing_file(directory / rel)
    for rel, entry in files.items():
        size = (directory / rel).stat().st_size
        if size != entry["size"]:
            raise wrong_size(directory / rel, size, entry)
    if not checksums:
        return data
    block = int(data.get("block_size") or hashing.BLOCK)
    checked = [rel for rel in files if skip is None or not skip(rel)]
    for key in hashing.KEYS:
        blocked = [rel for rel in checked if key in files[rel]]
        ends = {directory / rel: e for rel in blocked if (e := entry_ends(files[rel])) is not None}
        for rel, got in zip(blocked, hashing.file_digests([directory / rel for rel in blocked], block, key, ends)):
            bad = hashing.first_bad_block(files[rel][key], got)
            if bad is not None:
                raise corrupted(directory / rel, files[rel], bad, block)
    for rel in checked:  # format version 1: one sha256 per file
        entry = files[rel]
        if entry_blocks(entry) is None and hashing.whole_file_digest(directory / rel) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {directory / rel} is corrupted (its sha256 differs from the "
                                  f"manifest's {entry['sha256'][:12]}...); load an earlier checkpoint or save again")
    return data
