"""The error every checkpoint module raises (re-exported as ``impel.CheckpointError`` and by ``layout``)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the directory or file and the fix."""
