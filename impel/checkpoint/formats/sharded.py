"""Sharded model and optimizer state through ``torch.distributed.checkpoint`` (DCP): for FSDP2's SHARDED_STATE_DICT.

Each rank writes its own shards (their raw bytes, one file per rank: ``dcp_raw``); DCP's metadata records the
global layout, so a checkpoint saved by N ranks loads on M ranks (resharding) and merges to one file on a single
process (:func:`load_full_state`). Layout: one DCP directory per object, ``model/`` (``model_1/`` ...) and
``optimizer/`` (``optimizer_1/`` ...).

DCP stores its ``.metadata`` with plain pickle; :class:`SafeFileSystemReader` reads it with an unpickler that
rebuilds only DCP's own metadata classes, so a doctored ``.metadata`` fails instead of running code.
"""
from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from impel.checkpoint import formats
from impel.checkpoint.formats import dcp_raw, named_state
from impel.checkpoint.formats.full import optimizer_state, pair_optimizers, suffix
from impel.checkpoint.io.files import crc32_off
from impel.checkpoint.io.verified import Manifest, open_checked, read_all
from impel.checkpoint.store.layout import CheckpointError
from impel.runtime.ranks.collectives import is_distributed

if TYPE_CHECKING:
    import os
    from collections.abc import Generator

    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.futures import Future

    from impel.checkpoint.saving.session import SaveSession

R = TypeVar("R")

FORMAT = formats.SHARDED.name

_DCP_METADATA = {"Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
                 "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}
_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": _DCP_METADATA,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata asks for {module}.{name}, which is not DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allowlist (no code execution), and whose files
    are checked against ``manifest`` as they are read (None: read unchecked)."""

    refused: CheckpointError | None = None

    def __init__(self, manifest: Manifest | None, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.manifest = manifest
        self.fs = _checking_file_system(manifest)
        self.metadata: Metadata | None = None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Chunks in raw shard files (``dcp_raw``) read here, the rest (earlier releases' files) by DCP."""
        assert self.metadata is not None, "DCP sets the reader up before it reads"
        rest, raw = dcp_raw.split_plan(self, plan)
        dcp_raw.read_raw(self, self.metadata, raw, planner)
        return super().read_data(rest, planner)

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            # checked while read; a missing file raises as in FileSystemReader (DCP falls back)
            data = read_all(self.manifest, path)
        except CheckpointError as exc:  # DCP swallows it and tries per-rank metadata: keep the real cause
            self.refused = exc
            raise
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            self.refused = CheckpointError(f"refusing to load DCP metadata {path} ({exc}); the file is corrupted "
                                           "or not written by torch.distributed.checkpoint: load an earlier checkpoint")
            raise self.refused from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _checking_file_system(manifest: Manifest | None) -> FileSystem:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _CheckingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
            if mode == "rb":
                with open_checked(manifest, Path(path)) as stream:
                    yield stream
            else:
                with super().create_stream(path, mode) as stream:
                    yield stream

    return _CheckingFileSystem()


def _dcp(call: Callable[..., R], *args: object, reader: SafeFileSystemReader | None = None, **kwargs: object) -> R:
    """Run a DCP save/load quietly (no single-process warning); a refused metadata file, or a damaged file found
    by the checking reader on any rank, surfaces as impel's CheckpointError naming the file."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return call(*args, **kwargs)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if reader is not None and reader.refused is not None:
            raise reader.refused from None
        failures = getattr(exc, "failures", None)  # DCP's: rank -> (exception, stack), gathered from every rank
        for _, failure in sorted(failures.items()) if isinstance(failures, dict) else ():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(cause)) from None
        raise


def _save_dcp(session: SaveSession, state: dict[str, object], path: Path) -> None:
    """``dcp.save`` of ``state`` into ``path`` with DCP's file writer writing raw chunk bytes (``dcp_raw``: no
    per-tensor ``torch.save``) through ``session.open``: hashed as written and fsynced in the background (during
    save_state), so DCP's own fsync is off. no_dist: every rank plans its own items (``dcp_raw.LocalPlanner``),
    nothing is exchanged, and the committing rank writes the merged metadata."""
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    with crc32_off():
        _dcp(dcp.save, state, storage_writer=dcp_raw.RawWriter(session, path, rank),
             planner=dcp_raw.LocalPlanner(rank), no_dist=True)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_distributed() else 0


def model_dir(index: int) -> str:
    return f"model{suffix(index)}"


def optimizer_dir(index: int) -> str:
    return f"optimizer{suffix(index)}"


def save_sharded(session: SaveSession, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], *,
                 skip_models: AbstractSet[int] = frozenset(),
                 options: StateDictOptions | None = None) -> Mapping[str, object]:
    """Every rank writes its shards of each model and optimizer into ``session.directory`` (in an asynchronous
    save: staged now, saved in the background); returns the strategy metadata section."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory = session.checkpoint_dir
    for i, model in enumerate(models):
        if i not in skip_models:
            state = named_state.model_state(model) if options is None else get_model_state_dict(model,
                                                                                               options=options)
            session.write(_save_dcp, {"model": state}, directory / model_dir(i))
    fresh = []
    for i, (opt, owner) in enumerate(zip(optimizers, pair_optimizers(models, optimizers))):
        fresh.append(not opt.state)
        session.write(_save_dcp, {"optimizer": optimizer_state(models[owner], opt, options)},
                      directory / optimizer_dir(i))
    return {"format": FORMAT, "models": [model_dir(i) for i in range(len(models))],
            "optimizers": [optimizer_dir(i) for i in range(len(optimizers))], "fresh_optimizers": fresh}


def load_sharded(manifest: Manifest | None, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 directory: Path,
                 metadata: Mapping[str, Any], *, skip_models: AbstractSet[int] = frozenset(),
                 options: StateDictOptions | None = None) -> None:
    """Every rank reads the shards it needs (any world size) into the prepared models and optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{directory} holds a {metadata.get('format')!r} checkpoint, not a sharded one; "
                              "load it with the full-state path (load_full)")
    # no_dist: each rank plans and reads what it needs alone (DCP's coordinated load gathers the plans, scatters
    # them back and gathers the reads: three collectives per directory, each waiting for the slowest rank's read);
    # a failure on any rank is shared by load_state's own collective
    no_dist = True
    for i, model in enumerate(models):
        if i in skip_models:
            continue
        model_state = {"model": get_model_state_dict(model, options=options)}
        reader = SafeFileSystemReader(manifest, directory / metadata["models"][i])
        partial = options is not None and not options.strict  # load_state(strict=False): keys may be missing
        planner = dcp.DefaultLoadPlanner(allow_partial_load=True) if partial else None
        _dcp(dcp.load, model_state, storage_reader=reader, planner=planner, no_dist=no_dist, reader=reader)
        set_model_state_dict(model, model_state["model"], options=options)
    for i, (opt, owner) in enumerate(zip(optimizers, pair_optimizers(models, optimizers))):
        if metadata.get("fresh_optimizers", [False] * len(optimizers))[i]:
            opt.state.clear()  # saved before its first step: nothing to restore
            continue
        opt_state = {"optimizer": get_optimizer_state_dict(models[owner], opt, options=options)}
        reader = SafeFileSystemReader(manifest, directory / metadata["optimizers"][i])
        _dcp(dcp.load, opt_state, storage_reader=reader, no_dist=no_dist, reader=reader)
        set_optimizer_state_dict(models[owner], opt, opt_state["optimizer"], options=options)


def load_full_state(manifest: Manifest | None, dcp_dir: Path) -> dict[str, Any]:
    """The whole state stored in one DCP directory, as ordinary tensors, on one process without a process group."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}  # torch's STATE_DICT_TYPE: nested as saved
    # The same private pair dcp_to_torch_save uses to rebuild a state dict from metadata alone; the public
    # dcp.load only fills keys the caller already has. Our reader replaces its unrestricted metadata unpickling.
    reader = SafeFileSystemReader(manifest, dcp_dir)
    _dcp(_load_state_dict, state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True,
         reader=reader)
    return state
