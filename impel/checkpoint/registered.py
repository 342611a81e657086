"""A registered object's state (``register_for_checkpointing``) written and read back at the save, not at resume."""
from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from impel.checkpoint import layout, staging
from impel.checkpoint.files import read_torch, write_torch
from impel.checkpoint.state import describe


@contextmanager
def _storable(what: str) -> Iterator[None]:
    """A registered object's state that torch.save (or staging's deep copy) cannot take: one message."""
    try:
        yield
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise layout.CheckpointError(f"cannot save {what}: its state_dict() holds something torch.save cannot "
                                     f"store ({exc}); return tensors, numbers, strings, lists and dicts") from None


def write_registered(index: int, obj: Any, path: Path) -> None:
    """Write a registered object's state and read it back safely now, not at resume time (an asynchronous save
    stages it now and writes and reads it back in the background)."""
    what = f"registered object {index}, {describe(obj)}"
    with _storable(what):
        state = obj.state_dict()
        deferred = staging.defer(_store_registered, state, what, path)
    if not deferred:
        _store_registered(state, what, path)


def _store_registered(state: Any, what: str, path: Path) -> None:
    with _storable(what):
        write_torch(state, path)
    read_torch(path, what)
