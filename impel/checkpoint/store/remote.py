"""Checkpoints on object storage (any fsspec URL: ``s3://``, ``gs://``, ``memory://``, ...).

Object stores have no atomic rename, so the local commit protocol (temporary directory, seal, rename) is redone:
a save is written and sealed as usual into a local staging directory, then uploaded under its final prefix with
every file but the commit object, and the commit object (``COMPLETE``, the sha256 of the manifest) is uploaded
LAST. A prefix without it (an interrupted upload) is never loaded, listed as a checkpoint, nor rotated; its files
stay (impel deletes only committed checkpoints it wrote, and only the files their manifest names). A load
downloads a committed prefix into a local temporary directory, where its digests are verified as for any
checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from impel.checkpoint.store import layout
from impel.config import environment

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# the extra that installs a scheme's fsspec implementation
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
STAGING_ENV = "IMPEL_STAGING_DIR"  # read by impel.config.environment.staging_dir
Location = str | os.PathLike[str] | None  # a checkpoint location as given: a path, a URL, or none


def scheme_of(value: Any) -> str | None:  # Any: callers pass what users gave (HF's resume flag too)
    """The URL scheme of a checkpoint location (``None``: a path; ``file://`` counts as a path)."""
    if value is None:
        return None
    match = _URL.match(os.fspath(value))
    if match is None or match.group(1).lower() == "file":
        return None
    return match.group(1).lower()


@dataclass(frozen=True)
class Remote:
    """A checkpoint prefix on a fsspec filesystem: ``url`` (no trailing slash) and its filesystem."""

    url: str
    fs: Any

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Remote:
        return Remote(self.url.rstrip("/").rsplit("/", 1)[0], self.fs)

    def child(self, name: str) -> Remote:
        return Remote(f"{self.url}/{name}", self.fs)

    def __str__(self) -> str:
        return self.url

    def committed(self) -> bool:
        return bool(self.fs.exists(f"{self.url}/{layout.MARKER_FILE}"))

    def has_objects(self) -> bool:
        try:
            return bool(self.fs.find(self.url))
        except FileNotFoundError:
            return False


def parse(value: Any, what: str) -> Remote | None:
    """``value`` as a :class:`Remote` when it is a URL other than ``file://``; ``None`` for a path. A scheme
    whose fsspec implementation is not installed raises one error naming the extra to install."""
    scheme = scheme_of(value)
    if scheme is None:
        return None
    text = os.fspath(value).rstrip("/")
    try:
        import fsspec  # type: ignore[import-untyped]
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        extra = _EXTRAS.get(scheme, "fsspec")
        raise layout.CheckpointError(
            f"{what}={text!r}: no filesystem for {scheme}:// URLs is installed ({exc}); install it with "
            f"`pip install 'impel[{extra}]'`, or save to a local or mounted path") from None
    fs, _ = url_to_fs(text)  # options from fsspec's configuration (FSSPEC_<PROTOCOL>_<KEY> variables) and env
    return Remote(text, fs)


def save_target(output_dir: Location, project_dir: Location, automatic_naming: bool, iteration: int,
                save_on_each_node: bool) -> Remote | None:
    """A save's object-storage target (``project_dir/checkpoints/checkpoint_N`` under automatic naming), or None
    for a local one."""
    if automatic_naming:
        root = parse(project_dir, "project_dir")
        url = None if root is None else root.child(layout.CHECKPOINTS_DIR).child(layout.checkpoint_name(iteration))
    else:
        url = parse(output_dir, "save_state(output_dir)")
    if url is not None and save_on_each_node:
        raise layout.CheckpointError(
            f"save_state to {url}: save_on_each_node=True is for node-local disks and an object store is shared by "
            "every node; set ProjectConfiguration(save_on_each_node=False)")
    return url


def locate(input_dir: Location, project_dir: Location, automatic_naming: bool) -> tuple[Path, str, int] | None:
    """``load_state``'s object-storage source downloaded: (the local copy, its URL, the next free iteration), or
    None when the source is local. Without ``input_dir``: the newest committed checkpoint under
    ``project_dir/checkpoints``."""
    if input_dir is not None:
        url = parse(input_dir, "load_state(input_dir)")
        return None if url is None else (download(url), url.url, 0)
    root = parse(project_dir, "project_dir") if automatic_naming else None
    if root is None:
        return None
    root = root.child(layout.CHECKPOINTS_DIR)
    found = list_complete(root)
    if not found:
        raise layout.CheckpointError(f"no complete checkpoint under {root} (a prefix without its {layout.MARKER_FILE} "
                                     "commit object is an interrupted upload, never loaded)")
    newest = found[-1][1]
    return download(newest), newest.url, next_free_iteration(root)


def source_url(local: Path, input_dir: Location, project_dir: Location, automatic_naming: bool) -> str | None:
    """The URL a ``load_state`` read from (its local copy: ``local``), on every rank; None for a local source."""
    if input_dir is not None:
        url = parse(input_dir, "load_state(input_dir)")
        return None if url is None else url.url
    root = parse(project_dir, "project_dir") if automatic_naming else None
    return None if root is None else root.child(layout.CHECKPOINTS_DIR).child(local.name).url


# --- local staging -------------------------------------------------------------------------------------------
def _private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) or accept it when it is this user's own directory, never a symlink."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise layout.CheckpointError(
            f"{path} (the local staging directory of object-storage checkpoints) is not a directory this user owns; "
            f"remove it or set {STAGING_ENV} to a directory of yours")
    return path


def staging_path(remote: Remote) -> Path:
    """Where every rank of this machine writes a save to ``remote`` before it is uploaded: the same path on every
    rank (an asynchronous save's ranks name it without a collective). ``$IMPEL_STAGING_DIR`` (a directory all
    ranks share, needed across machines) or the system's temporary directory."""
    base = Path(environment.staging_dir() or tempfile.gettempdir()) / f"impel-staging-{os.getuid()}"
    digest = hashlib.sha256(remote.parent.url.encode()).hexdigest()[:16]
    return _private_dir(_private_dir(base) / digest) / remote.name


def clear_staging(local: Path) -> None:
    """Remove what an earlier save left in its staging directory (impel's own; a crash between seal and upload)."""
    shutil.rmtree(local, ignore_errors=True)


# --- upload, commit, rotation --------------------------------------------------------------------------------
def check_target(remote: Remote, automatic_naming: bool, iteration: int) -> None:
    """Before anything is written: an automatic name that exists (committed or not) raises, naming the next free
    one; an explicit prefix holding objects but no commit object (not a checkpoint of impel's) raises."""
    if not remote.has_objects():
        return
    if automatic_naming:
        raise layout.CheckpointError(
            f"{remote} already exists (ProjectConfiguration.iteration={iteration}); set "
            f"accelerator.project_configuration.iteration = {next_free_iteration(remote.parent)} or call "
            "load_state() first, which sets it")
    if not remote.committed():
        raise layout.CheckpointError(
            f"{remote} holds objects but no {layout.MARKER_FILE} commit object (not an impel checkpoint, or an "
            "interrupted upload); impel does not overwrite what it did not write: remove that prefix or save to "
            "another one")


def upload(local: Path, remote: Remote) -> None:
    """Upload the sealed checkpoint ``local`` under ``remote``: an existing committed checkpoint there is first
    uncommitted (its commit object deleted) and its files removed, then every file but the commit object is
    uploaded, and the commit object last."""
    if remote.committed():
        _remove_committed(remote)
    put_tree(local, remote, layout.MARKER_FILE)


def put_tree(local: Path, remote: Remote, marker: str, skip: tuple[str, ...] = ()) -> None:
    """Every file under ``local`` to the same path under ``remote``, the file named ``marker`` last (a prefix
    without it is an upload cut short); files named in ``skip`` stay local."""
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != marker and p.name not in skip)
    for path in files:
        remote.fs.put_file(str(path), f"{remote.url}/{path.relative_to(local).as_posix()}")
    remote.fs.put_file(str(local / marker), f"{remote.url}/{marker}")


def get_tree(remote: Remote, local: Path, marker: str) -> None:
    """Every object under ``remote`` into ``local`` (created), the one named ``marker`` last, so a download cut
    short has no marker; keys with ``..`` are skipped."""
    local.mkdir(parents=True, exist_ok=True)
    prefix = remote.fs._strip_protocol(remote.url)
    keys = sorted(str(key) for key in remote.fs.find(remote.url))
    for key in sorted(keys, key=lambda k: k.endswith("/" + marker)):
        rel = key[len(prefix):].lstrip("/")
        if not rel or ".." in rel.split("/"):
            continue
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        remote.fs.get_file(key, str(local / rel))


def _manifest(remote: Remote) -> dict[str, Any]:
    with remote.fs.open(f"{remote.url}/{layout.METADATA_FILE}", "rb") as handle:
        body = json.loads(handle.read())
    return body if isinstance(body, dict) else {}


def _remove_committed(remote: Remote) -> None:
    """Delete a committed checkpoint: its commit object first (it is then never loaded), then the files its
    manifest names and the manifest. Anything else under the prefix (not impel's) stays."""
    names = [rel for rel in _manifest(remote).get("files", {}) if isinstance(rel, str) and ".." not in rel.split("/")]
    remote.fs.rm_file(f"{remote.url}/{layout.MARKER_FILE}")
    for rel in names:
        try:
            remote.fs.rm_file(f"{remote.url}/{rel}")
        except FileNotFoundError:
            pass
    remote.fs.rm_file(f"{remote.url}/{layout.METADATA_FILE}")
    if not remote.has_objects():  # only empty (pseudo-)directories left, as on filesystems with directories
        try:
            remote.fs.rm(remote.url, recursive=True)
        except (FileNotFoundError, OSError):
            pass


def _children(root: Remote) -> list[str]:
    try:
        entries = root.fs.ls(root.url, detail=False)
    except FileNotFoundError:
        return []
    return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]


def list_complete(root: Remote) -> list[tuple[int, Remote]]:
    """Committed ``checkpoint_N`` prefixes under ``root``, oldest first (a prefix without its commit object, an
    interrupted upload, is skipped)."""
    found = []
    for name in _children(root):
        number = layout.parse_iteration(name)
        if number is not None and root.child(name).committed():
            found.append((number, root.child(name)))
    return sorted(found, key=lambda item: item[0])


def next_free_iteration(root: Remote) -> int:
    """One more than the highest ``checkpoint_N`` under ``root`` (committed or not: never reused), or 0."""
    numbers = [layout.parse_iteration(name) for name in _children(root)]
    return max((n for n in numbers if n is not None), default=-1) + 1


def rotate(root: Remote, total_limit: int | None) -> list[str]:
    """Remove the oldest committed checkpoints so that at most ``total_limit`` remain."""
    if total_limit is None:
        return []
    found = list_complete(root)
    doomed = [remote for _, remote in found[: max(0, len(found) - total_limit)]]
    for remote in doomed:
        _remove_committed(remote)
    return [remote.url for remote in doomed]


# --- download --------------------------------------------------------------------------------------------------
def download(remote: Remote) -> Path:
    """A committed checkpoint copied into a new local temporary directory (verified by the caller as any local
    checkpoint); raises for a prefix without its commit object."""
    if not remote.committed():
        raise layout.CheckpointError(
            f"{remote} is not a complete checkpoint: it has no {layout.MARKER_FILE} commit object (an interrupted "
            "upload, or not an impel checkpoint); load a committed one")
    base = Path(environment.staging_dir() or tempfile.gettempdir())
    local = Path(tempfile.mkdtemp(prefix="impel-download-", dir=base)) / remote.name
    get_tree(remote, local, layout.MARKER_FILE)
    return local
