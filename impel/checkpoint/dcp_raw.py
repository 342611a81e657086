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
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from impel.checkpoint.digests import appending

RAW_SUFFIX = ".raw.distcp"


def is_raw(relative_path: str) -> bool:
    return str(relative_path).endswith(RAW_SUFFIX)


class RawWriter(FileSystemWriter):
    """DCP's file writer with one raw-bytes shard file per rank (fsync and checksums: ``digests.appending``)."""

    def __init__(self, path: Any) -> None:
        super().__init__(path, sync_files=False)

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.planner import WriteItemType

        name = f"{plan.storage_data.prefix}0{RAW_SUFFIX}"
        results = []
        with appending(Path(self.path) / name) as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    stream.write(_raw_bytes(data))
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    view: memoryview = tensor.reshape(-1).view(torch.uint8).numpy().data
    return view


def read_raw(reader: Any, metadata: Any, items: list[Any], planner: Any) -> None:
    """Load the read items stored in raw shard files into the planner's tensors (one pass per file, in order)."""
    from torch.distributed.checkpoint.planner import LoadItemType

    per_file: dict[str, list[Any]] = {}
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
                dtype = metadata.state_dict_metadata[request.storage_index.fqn].properties.dtype
                tensor = torch.empty(chunk.sizes, dtype=dtype)
                if info.length != tensor.numel() * tensor.element_size():
                    raise ValueError(f"{relative_path}: {request.storage_index.fqn} holds {info.length} bytes, "
                                     f"its chunk {list(chunk.sizes)} of {dtype} needs "
                                     f"{tensor.numel() * tensor.element_size()}")
                if tensor.numel():
                    _fill(stream, tensor.reshape(-1).view(torch.uint8).numpy().data)
                for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths)):
                    tensor = tensor.narrow(dim, start, length)
                target = planner.resolve_tensor(request).detach()
                target.copy_(tensor)
                planner.commit_tensor(request, target)


def split_plan(reader: Any, plan: Any) -> tuple[Any, list[Any]]:
    """``plan`` without its raw items (for DCP's own reader), and the raw items."""
    raw = [item for item in plan.items if is_raw(reader.storage_data[item.storage_index].relative_path)]
    rest = [item for item in plan.items if not is_raw(reader.storage_data[item.storage_index].relative_path)]
    return dataclasses.replace(plan, items=rest), raw


def _chunk(metadata: Any, index: Any) -> Any:
    chunks = metadata.state_dict_metadata[index.fqn].chunks
    if index.index is not None and index.index < len(chunks) and list(chunks[index.index].offsets) == list(
            index.offset):
        return chunks[index.index]
    for chunk in chunks:
        if list(chunk.offsets) == list(index.offset):
            return chunk
    raise ValueError(f"no chunk of {index.fqn} starts at {list(index.offset)} in the DCP metadata")


def _exactly(stream: Any, n: int) -> bytes:
    data = bytearray(n)
    _fill(stream, memoryview(data))
    return bytes(data)


def _fill(stream: Any, view: memoryview) -> None:
    view = view.cast("B")
    while view.nbytes:
        got = stream.readinto(view)
        if not got:
            raise ValueError("the shard file ends before the data its metadata lists")
        view = view[got:]
