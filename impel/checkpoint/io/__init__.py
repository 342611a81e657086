"""Checkpoint bytes: files written, hashed and read back safely (a room of ``impel.checkpoint``, layer 3).

``files`` (the writers and readers of ``torch.save`` and safetensors files: writers take the save's
``saving.session.SaveSession``, readers the checkpoint's ``verified.Manifest``), ``safetensors_stream`` (safetensors
written and read as a stream, straight into tensors), ``direct_io`` (files written around the page cache on I/O
threads), ``hashing`` (the manifest's XXH3 block digests), ``digests`` (digests computed while files are written,
shared across ranks), ``verified`` (files checked against the manifest while they are read), ``restricted``
(Accelerate's pickles, unpickled through an allowlist).

Adding a file kind: write through ``SaveSession.open`` (hashed and fsynced in the background during a save) and read
through ``verified.open_checked`` with the manifest.
"""
