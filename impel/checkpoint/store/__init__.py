"""Checkpoint directories: where a checkpoint lives and how it becomes complete (a room of ``impel.checkpoint``,
layer 3).

``layout`` (names, the manifest, the marker, the atomic commit, verification, rotation), ``target`` (the target
checked before anything is written: symlinks, files in the path, mount points, free space), ``tempdirs`` (a save's
temporary directory, its lock, the cleaning of dead ones), ``ownership`` (which files are the checkpoint's and which
the user's), ``storage`` (a full disk or a read-only target as one line), ``remote`` (checkpoints on object storage:
a local staging directory, the commit object uploaded last).

Adding a storage: the commit protocol lives in ``layout.commit`` (local) and ``remote.upload`` (object stores); a new
one keeps the rule that a checkpoint counts only once complete and verified, and never deletes what impel did not
write (``ownership``).
"""
