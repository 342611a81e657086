"""Where a ``save_state`` may write, checked before anything is written: the target is not the user's directory,
not inside a checkpoint, not an existing checkpoint under automatic naming, and lies on a writable filesystem with
room for the state; and the room a save asks for (:class:`NeededBytes`)."""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from impel.checkpoint.store import layout, ownership, storage

if TYPE_CHECKING:
    import torch

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def local_path(value: str | os.PathLike[str], what: str) -> Path:
    """A checkpoint location as a local (or mounted) path: ``file://`` URLs become their path; any other URL
    (``s3://``, ``gs://``, ...) raises instead of becoming a local folder named ``s3:``."""
    text = os.fspath(value)
    match = _URL.match(text)
    if match and match.group(1).lower() == "file":
        text = text[len("file://"):]
    elif match:
        raise layout.CheckpointError(
            f"{what}={text!r} is a {match.group(1)}:// URL, where a local path is needed here; save_state, "
            "load_state and auto-resume take object-storage URLs (docs/checkpoints.md#object-storage)")
    return Path(text).expanduser().absolute()


def prepare(final: Path, temp: Path, clean: bool, automatic_naming: bool, iteration: int,
            needed: Callable[[], int]) -> str:
    """Check that ``final`` may be saved to and create its parent; ``clean``: first delete the leftovers of
    interrupted saves there (all but ``temp``, which other ranks may be filling already). ``str(temp)``."""
    check_location(final)
    with storage.translated(final, temp, needed):
        storage.check_room(final, 0)  # a read-only filesystem, named before mkdir names a parent the user did not give
        final.parent.mkdir(parents=True, exist_ok=True)
        if clean:
            layout.clean_incomplete(final.parent, keep=temp)
    if automatic_naming and final.exists():
        raise layout.CheckpointError(
            f"{final} already exists (ProjectConfiguration.iteration={iteration}); set "
            f"accelerator.project_configuration.iteration = {layout.next_free_iteration(final.parent)} or "
            "call load_state() first, which sets it")
    layout.check_target(final)
    ownership.check_save_target(final)
    storage.check_room(final, needed())  # before anything is written
    return str(temp)


def check_location(final: Path) -> None:
    """Refuse, in one line, a target a save cannot rename a new directory onto: a file in its path, a symbolic link
    (the rename would replace the link by a directory) or a mount point (the rename fails with EBUSY)."""
    for parent in reversed(final.parents):  # from the root down to the first missing one
        if not os.path.lexists(parent):
            break
        if not parent.is_dir():
            kind = "a broken symbolic link" if parent.is_symlink() else "a file"
            raise layout.CheckpointError(
                f"save_state output_dir {final}: {parent} is {kind}, not a directory; pass a path whose parents are "
                f"directories (or move {parent} away)")
    if final.is_symlink():
        raise layout.CheckpointError(
            f"save_state output_dir {final} is a symbolic link (to {os.readlink(final)}); a save renames a new "
            f"directory into place, which would replace the link: pass the directory it points to ({final.resolve()})")
    if os.path.ismount(final):
        raise layout.CheckpointError(
            f"save_state output_dir {final} is a mount point; a save renames a new directory into place, which a "
            f"mount point cannot be: pass a directory inside it (e.g. {final / 'checkpoint'})")


class NeededBytes:
    """The bytes a save asks room for (``storage.state_bytes``). Its sum walks every module (~1 ms a call under
    FSDP2, a few % of an asynchronous save's call), so it is kept while the same models and optimizers hold as many
    states (a prepared model's tensors keep their sizes; an optimizer's states appear with its first step)."""

    def __init__(self) -> None:
        self._last: tuple[object, int] | None = None  # (the objects' identities and state counts, their bytes)

    def __call__(self, models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> int:
        models, optimizers = list(models), list(optimizers)
        key = (tuple(map(id, models)), tuple((id(o), _state_count(o)) for o in optimizers))
        if self._last is None or self._last[0] != key:
            self._last = (key, storage.state_bytes(models, optimizers))
        return self._last[1]


def _state_count(optimizer: object) -> int:
    state = getattr(optimizer, "state", None)
    return len(state) if isinstance(state, Mapping) else -1
