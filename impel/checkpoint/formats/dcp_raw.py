"""DCP shard files holding each tensor chunk's raw bytes instead of one ``torch.save`` archive per chunk.

DCP's ``FileSystemWriter`` pickles every tensor chunk with ``torch.save`` into the rank's ``.distcp`` file (a zip
archive per chunk: ~40 small writes, a pickle and the zip records each), and its reader unpickles them again.
DCP's planner and metadata already record everything needed to read a chunk back (the tensor's dtype in
``TensorStorageMetadata.properties``, the chunk's sizes, and per chunk the file, offset and length), so
:class:`RawWriter` writes the chunk's bytes as they are in memory, one ``write`` per chunk, into an append-only
file hashed as it passes (``digests.appending``), and :func:`read_raw` reads each chunk straight into a new tensor
through the checking reader (``verified``), in file order. Everything else (planning, the ``.metadata`` file,
resharding on load, non-tensor items) is DCP's own. Files in this layout are named ``__<rank>_<n>.raw.distcp``:
DCP's stock reader refuses them (``torch.load`` of raw bytes fails) instead of misreading them, and directories
written with per-chunk ``torch.save`` (earlier impel releases) keep loading through DCP's own code.
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from impel.runtime.ranks.collectives import is_distributed

if TYPE_CHECKING:
    import os

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import (
        STORAGE_TYPES,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem

    from impel.checkpoint.saving.session import SaveSession

RAW_SUFFIX = ".raw.distcp"
METADATA_NAME = ".metadata"


def is_raw(relative_path: str) -> bool:
    return str(relative_path).endswith(RAW_SUFFIX)


class RawWriter(FileSystemWriter):
    """DCP's file writer with one raw-bytes shard file per rank (fsync and checksums: ``SaveSession.open``).

    Run with ``no_dist=True`` and :class:`LocalPlanner`: no collective at all. Each rank plans and writes its own
    items into ``__<rank>_0.raw.distcp`` (its shards) and ``__<rank>_1.raw.distcp`` (rank 0: what every rank
    holds alike) and hands the metadata of its items to the save (``SaveSession.contribute``);
    the committing rank merges every rank's into the directory's ``.metadata`` (:func:`write_merged`), which is
    the same global metadata DCP's coordinated save writes (DCP's save gathers the plans to rank 0, scatters them
    back, gathers the write results and broadcasts the metadata: four object collectives per directory, each
    waiting for the slowest rank, which cost a sharded save as much as a third of its time)."""

    def __init__(self, session: SaveSession, path: str | os.PathLike[str], rank: int = 0) -> None:
        super().__init__(path, sync_files=False)
        self.session = session  # the save it writes for: its files sealed, its metadata merged at the commit
        self.global_rank = rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        from torch.distributed.checkpoint.filesystem import _StoragePrefix

        self.fs.mkdir(self.path)
        return dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.global_rank}_"))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans  # one rank's own plan, already named after the rank

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """This rank's items' metadata, with where each one is stored, handed to the save (merged and written by
        the committing rank); on one process outside ``save_state`` written as the directory's ``.metadata``."""
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for writes in results for result in writes}
        metadata.storage_meta = self.storage_meta()
        if self.session.contribute(Path(self.path) / METADATA_NAME, metadata):
            return
        if is_distributed():
            raise RuntimeError("a sharded save on several ranks runs inside save_state (its ranks' metadata are "
                               "merged when it commits)")
        write_merged(Path(self.path) / METADATA_NAME, [metadata], sync=True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's DTensor shards into ``__<rank>_0.raw.distcp``, and what is the same on every rank (plain
        tensors, objects: rank 0's) into a small ``__<rank>_1.raw.distcp`` of their own, so that a rank that needs
        them reads (and verifies) that file instead of the other rank's whole shard file."""
        from torch.distributed.checkpoint.planner import WriteItemType

        shards = [item for item in plan.items if item.type == WriteItemType.SHARD]
        shared = [item for item in plan.items if item.type != WriteItemType.SHARD]
        results: list[WriteResult] = []
        for number, items in enumerate((shards, shared)):
            if items:
                results += self._write_file(f"{plan.storage_data.prefix}{number}{RAW_SUFFIX}", items, planner)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        results = []
        with self.session.open(Path(self.path) / name) as stream:
            for item in items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if isinstance(data, io.BytesIO):  # a BYTE_IO item (WriteItemType.BYTE_IO)
                    stream.write(data.getbuffer())
                else:
                    stream.write(_raw_bytes(data))
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
        return results


class LocalPlanner(DefaultSavePlanner):
    """DCP's default save planner for one rank planning alone: each stored item is written by one rank only, as
    DCP's coordinated planning decides (a DTensor shard by the first replica of its box, plain tensors and other
    objects, identical on every rank, by rank 0)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.global_rank = rank

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if self._writes(item)]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _writes(self, item: WriteItem) -> bool:
        from torch.distributed.tensor import DTensor, Replicate

        value = self.state_dict.get(item.index.fqn)
        if isinstance(value, DTensor):
            coordinate = value.device_mesh.get_coordinate()
            return coordinate is not None and all(
                c == 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate))
        return self.global_rank == 0


def merge(parts: list[Metadata]) -> Metadata:
    """The global DCP metadata of a directory from every rank's metadata of its own items (in rank order)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    merged: dict[str, STORAGE_TYPES] = {}
    storage: dict[MetadataIndex, object] = {}  # DCP types a directory's storage data as Any: passed on here
    planner_data: dict[str, object] = {}
    for part in parts:
        for fqn, entry in part.state_dict_metadata.items():
            have = merged.get(fqn)
            if have is None:
                merged[fqn] = dataclasses.replace(entry, chunks=list(entry.chunks)) if isinstance(
                    entry, TensorStorageMetadata) else entry
            elif isinstance(entry, TensorStorageMetadata) and isinstance(have, TensorStorageMetadata):
                known = {tuple(chunk.offsets) for chunk in have.chunks}
                have.chunks.extend(c for c in entry.chunks if tuple(c.offsets) not in known)
        for index, info in part.storage_data.items():
            storage.setdefault(index, info)
        planner_data.update(part.planner_data or {})
    for entry in merged.values():
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks.sort(key=lambda chunk: tuple(chunk.offsets))
    return dataclasses.replace(parts[0], state_dict_metadata=merged, storage_data=storage,
                              planner_data=planner_data)


def write_merged(path: Path, parts: list[Metadata], sync: bool = False) -> None:
    """Merge the ranks' metadata (:func:`merge`) and write it as ``path`` (a DCP directory's ``.metadata``);
    ``sync``: fsync it (``save_state``'s commit fsyncs it with the manifest instead)."""
    with open(path, "wb") as f:
        pickle.dump(merge(parts), f)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    view: memoryview = tensor.reshape(-1).view(torch.uint8).numpy().data
    return view


def read_raw(reader: FileSystemReader, metadata: Metadata, items: list[ReadItem], planner: LoadPlanner) -> None:
    """Load the read items stored in raw shard files into the planner's tensors (one pass per file, in order)."""
    from torch.distributed.checkpoint.planner import LoadItemType

    per_file: dict[str, list[ReadItem]] = {}
    for item in items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    for relative_path, requests in per_file.items():
        requests.sort(key=lambda r: reader.storage_data[r.storage_index].offset)
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, relative_path), "rb") as stream:
            for request in requests:
                info = reader.storage_data[request.storage_index]
                stream.seek(info.offset)
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(_exactly(stream, info.length)))
                    continue
                chunk = _chunk(metadata, request.storage_index)
                dtype = _tensor_entry(metadata, request.storage_index.fqn).properties.dtype
                needed = math.prod(chunk.sizes) * dtype.itemsize
                if info.length != needed:
                    raise ValueError(f"{relative_path}: {request.storage_index.fqn} holds {info.length} bytes, "
                                     f"its chunk {list(chunk.sizes)} of {dtype} needs {needed}")
                target = planner.resolve_tensor(request).detach()
                if _whole(request, chunk) and _fits(target, chunk.sizes, dtype):
                    if target.numel():  # straight into the destination (same world size: the rank's own shard)
                        _fill(stream, target.reshape(-1).view(torch.uint8).numpy().data)
                    planner.commit_tensor(request, target)
                    continue
                tensor = torch.empty(chunk.sizes, dtype=dtype)
                if tensor.numel():
                    _fill(stream, tensor.reshape(-1).view(torch.uint8).numpy().data)
                for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths)):
                    tensor = tensor.narrow(dim, start, length)
                target.copy_(tensor)
                planner.commit_tensor(request, target)


def _whole(request: ReadItem, chunk: ChunkStorageMetadata) -> bool:
    """The request reads the whole stored chunk (not a slice of it, as a resharding load may)."""
    return all(start == 0 for start in request.storage_offsets) and list(request.lengths) == list(chunk.sizes)


def _fits(target: torch.Tensor, sizes: torch.Size, dtype: torch.dtype) -> bool:
    """The destination can take the stored bytes as they are: a contiguous CPU tensor of that shape and dtype."""
    return (type(target) is torch.Tensor and target.device.type == "cpu" and target.dtype == dtype
            and tuple(target.shape) == tuple(sizes) and target.is_contiguous())


def split_plan(reader: FileSystemReader, plan: LoadPlan) -> tuple[LoadPlan, list[ReadItem]]:
    """``plan`` without its raw items (for DCP's own reader), and the raw items."""
    raw = [item for item in plan.items if is_raw(reader.storage_data[item.storage_index].relative_path)]
    rest = [item for item in plan.items if not is_raw(reader.storage_data[item.storage_index].relative_path)]
    return dataclasses.replace(plan, items=rest), raw


def _chunk(metadata: Metadata, index: MetadataIndex) -> ChunkStorageMetadata:
    chunks = _tensor_entry(metadata, index.fqn).chunks
    offset = index.offset
    assert offset is not None, index  # a tensor's index names the offset of its chunk
    if index.index is not None and index.index < len(chunks) and list(chunks[index.index].offsets) == list(
            offset):
        return chunks[index.index]
    for chunk in chunks:
        if list(chunk.offsets) == list(offset):
            return chunk
    raise ValueError(f"no chunk of {index.fqn} starts at {list(offset)} in the DCP metadata")


def _tensor_entry(metadata: Metadata, fqn: str) -> TensorStorageMetadata:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = metadata.state_dict_metadata[fqn]
    if not isinstance(entry, TensorStorageMetadata):
        raise ValueError(f"{fqn} is stored as bytes in the DCP metadata, not as a tensor chunk")
    return entry


def _exactly(stream: Any, n: int) -> bytes:
    data = bytearray(n)
    _fill(stream, memoryview(data))
    return bytes(data)


def _fill(stream: Any,  # DCP's file system opens an io.IOBase, which declares no readinto
          view: memoryview) -> None:
    view = view.cast("B")
    while view.nbytes:
        got = stream.readinto(view)
        if not got:
            raise ValueError("the shard file ends before the data its metadata lists")
        view = view[got:]
