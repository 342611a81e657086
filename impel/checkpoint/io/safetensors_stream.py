"""The safetensors format written to and read from a stream, front to back, without an intermediate copy.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
range, plus string metadata) padded with spaces to 8 bytes, then the tensors' bytes. ``safetensors.save_file``
writes it from Rust after the fact, so the manifest had to read the file back to hash it, and ``safe_open`` maps
it, so a check had to read it once more. Here the writer streams each tensor's own memory into the checkpoint's
append-only file (hashed as it passes: ``digests.appending``), and the reader reads each tensor's bytes straight
into a new tensor's memory through the verifying reader (``verified``). The files are ordinary safetensors files:
``safetensors.safe_open`` reads them and these functions read files written by safetensors.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_NAMES = {name: dtype for dtype, name in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit


class Reader(Protocol):
    """What reading a safetensors file calls on its stream (a file, ``verified``'s checking reader)."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...

    def seek(self, offset: int, whence: int = ..., /) -> int: ...


class Writer(Protocol):
    """What writing a safetensors file calls on its stream (``SaveSession.open``'s file)."""

    def write(self, data: bytes | memoryview, /) -> int: ...


def header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length and the padded JSON header of ``tensors`` stored in their mapping order."""
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    at = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], stream: Writer) -> None:
    """Write CPU tensors (contiguous or not) and string metadata to ``stream`` as one safetensors file."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    stream.write(header(tensors, metadata))
    for tensor in tensors.values():
        if tensor.numel():
            stream.write(_bytes(tensor))


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy)."""
    view: memoryview = tensor.reshape(-1).view(torch.uint8).numpy().data
    return view


def read_header(stream: Reader) -> tuple[dict[str, Any], dict[str, str], int]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets), its string metadata and the file
    offset where the data starts; ValueError names what is malformed."""
    length = int.from_bytes(_exactly(stream, 8), "little")
    if length > _MAX_HEADER:
        raise ValueError(f"header length {length} is implausible")
    entries = json.loads(_exactly(stream, length))
    if not isinstance(entries, dict):
        raise ValueError("the header is not a JSON object")
    metadata = entries.pop("__metadata__", None) or {}
    for name, entry in entries.items():
        dtype, shape = _NAMES.get(entry.get("dtype")), tuple(entry.get("shape", ()))
        start, end = entry["data_offsets"]
        if dtype is None or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r} has an invalid header entry {entry}")
    return entries, {str(k): str(v) for k, v in metadata.items()}, 8 + length


def dtype_of(entry: dict[str, Any]) -> torch.dtype:
    """The torch dtype of a header entry checked by :func:`read_header`."""
    return _NAMES[entry["dtype"]]


def read(stream: Reader) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file (in file order) and its metadata; ValueError names what is malformed."""
    entries, metadata, base = read_header(stream)
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
        tensor = torch.empty(tuple(entry["shape"]), dtype=dtype_of(entry))
        if tensor.numel():
            stream.seek(base + entry["data_offsets"][0])
            fill(stream, _bytes(tensor))
        tensors[name] = tensor
    return tensors, metadata


def _exactly(stream: Reader, n: int) -> bytes:
    data = bytearray(n)
    fill(stream, memoryview(data))
    return bytes(data)


def fill(stream: Reader, view: memoryview) -> None:
    """Read exactly ``view``'s bytes from ``stream`` into it (ValueError when the file ends first)."""
    while view.nbytes:
        got = stream.readinto(view)
        if not got:
            raise ValueError("the file ends before the data its header lists")
        view = view[got:]
