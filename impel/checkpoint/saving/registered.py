"""A registered object's state (``register_for_checkpointing``) written and read back at the save, not at resume."""
from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from impel.checkpoint.io.files import read_torch, write_torch
from impel.checkpoint.saving.state import describe
from impel.checkpoint.store import layout

if TYPE_CHECKING:
    from impel.checkpoint.saving.session import SaveSession


@contextmanager
def _storable(what: str) -> Iterator[None]:
    """A registered object's state that torch.save (or staging's deep copy) cannot take: one message."""
    try:
        yield
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise layout.CheckpointError(f"cannot save {what}: its state_dict() holds something torch.save cannot "
                                     f"store ({exc}); return tensors, numbers, strings, lists and dicts") from None


def write_registered(session: SaveSession, index: int, obj: Any, path: Path) -> None:
    """Write a registered object's state and read it back safely now, not at resume time (an asynchronous save
    stages it now and writes and reads it back in the background)."""
    what = f"registered object {index}, {describe(obj)}"
    with _storable(what):
        state = obj.state_dict()
        session.write(_store_registered, state, what, path)  # staging: a deep copy of the state, taken now


def _store_registered(session: SaveSession, state: object, what: str, path: Path) -> None:
    with _storable(what):
        write_torch(session, state, path)
    session.settle(path)  # finished in the background: the read-back waits for it
    read_torch(None, path, what)  # no manifest yet (this save makes it): the state loads back safely
