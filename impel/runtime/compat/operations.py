"""Accelerate's tensor-structure helpers (``accelerate.utils.operations`` beyond the collectives): concatenating,
listing, slicing and casting nested lists / tuples / dicts of tensors, finding their batch size and device.

The collectives themselves (gather, reduce, broadcast, ...) live in :mod:`impel.runtime.ranks.collectives`.

Example::

    concatenate([{"x": torch.ones(2)}, {"x": torch.zeros(3)}])   # {"x": tensor of 5}
    find_batch_size({"input_ids": torch.ones(8, 128)})           # 8
"""
from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, ParamSpec, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from impel.runtime.ranks.collectives import (  # re-exported: Accelerate's path
    CannotPadNestedTensorWarning as CannotPadNestedTensorWarning,
)
from impel.runtime.ranks.collectives import (
    DistributedOperationException as DistributedOperationException,
)
from impel.runtime.ranks.collectives import is_distributed, is_torch_tensor, recursively_apply, reduce

T = TypeVar("T")
S = TypeVar("S", bound=Sequence[object])
P = ParamSpec("P")
R = TypeVar("R")
# what ``tensor[...]`` takes
TensorIndex: TypeAlias = slice | int | torch.Tensor | tuple[slice | int | torch.Tensor | None, ...] | None
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class TensorInformation:
    """The shape and dtype of a tensor to be built elsewhere (:func:`initialize_tensors`)."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: object) -> bool:
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: object) -> bool:
    """Whether ``data`` is a ``namedtuple`` instance."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: S, generator: Iterable[object]) -> S:
    """The items of ``generator`` in a container of ``obj``'s type (list, tuple or namedtuple)."""
    rebuild: Callable[..., S] = type(obj)
    if is_namedtuple(obj):
        return rebuild(*list(generator))
    return rebuild(generator)


def listify(data: object) -> Any:
    """Tensors in a nested structure become (nested) Python lists of numbers (bf16 through fp32)."""
    def to_list(t: torch.Tensor) -> object:
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).tolist()

    return recursively_apply(to_list, data)


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-structured nested tensors along ``dim`` (a list of one item is returned as is)."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        rebuild: Callable[..., object] = type(first)
        return rebuild({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if isinstance(data, (tuple, list)) and len(data) == 1:
        return first
    raise TypeError(f"concatenate can only join tensors (in lists, tuples or dicts), got {type(first).__name__}")


def find_batch_size(data: object) -> int:
    """The first dimension of the first tensor found in a nested structure."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}; pass a batch of tensors")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, got {type(data).__name__}")
    return int(data.shape[0])


def ignorant_find_batch_size(data: object) -> int | None:
    """:func:`find_batch_size`, or None where it raises."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def find_device(data: object) -> torch.device | None:
    """The device of the first tensor found in a nested structure (None without one)."""
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        for item in data:
            device = find_device(item)
            if device is not None:
                return device
        return None
    return data.device if isinstance(data, torch.Tensor) else None


def get_data_structure(data: object) -> Any:
    """The structure of ``data`` with each tensor replaced by its :class:`TensorInformation`."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: object) -> Any:
    """Empty tensors in place of each :class:`TensorInformation` of ``data_structure``."""
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)


def slice_tensors(data: T, tensor_slice: TensorIndex, process_index: int | None = None,
                  num_processes: int | None = None) -> T:
    """``t[tensor_slice]`` for every tensor in a nested structure."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def convert_to_fp32(tensor: T) -> T:
    """fp16 / bf16 tensors in a nested structure become fp32; the rest is returned as it is."""
    return recursively_apply(lambda t: t.float(), tensor,
                             test_type=lambda t: hasattr(t, "dtype") and t.dtype in _LOW_PRECISION)


class ConvertOutputsToFp32(Generic[P, R]):
    """Wrap a forward so its fp16 / bf16 outputs come back in fp32 (not picklable, as Accelerate's)."""

    def __init__(self, model_forward: Callable[P, R]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> NoReturn:
        raise pickle.PicklingError("cannot pickle a forward wrapped to return fp32; unwrap the model with "
                                   "accelerator.unwrap_model(model) before pickling it")


def convert_outputs_to_fp32(model_forward: Callable[P, R]) -> Callable[P, R]:
    """``model_forward`` returning fp32 outputs; ``__wrapped__`` holds the wrapper, as Accelerate's (so
    :func:`impel.utils.extract_model_from_parallel` with ``keep_fp32_wrapper=False`` removes it)."""
    wrapped = ConvertOutputsToFp32(model_forward)

    def forward(*args: P.args, **kwargs: P.kwargs) -> R:
        return wrapped(*args, **kwargs)

    forward.__wrapped__ = wrapped  # type: ignore[attr-defined]
    return forward


def pad_input_tensors(tensor: T, batch_size: int, num_processes: int, dim: int = 0) -> T:
    """Zero-pad each tensor's first dimension from ``batch_size`` to a size that splits over ``num_processes`` as
    Accelerate's ``pad_input_tensors`` does."""
    def one(t: torch.Tensor) -> torch.Tensor:
        per = batch_size // num_processes
        last_inputs = batch_size - per * num_processes
        to_pad = num_processes - batch_size if per == 0 else num_processes - per
        if last_inputs > to_pad & to_pad < 1:  # Accelerate's expression, precedence included
            to_pad = last_inputs - to_pad
        shape = list(t.shape)
        shape[0] = batch_size + to_pad
        out = t.new_zeros(tuple(shape))
        out[tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(len(shape)))] = t
        return out

    return recursively_apply(one, tensor, error_on_other_type=True)


_DTYPE_CODES = [torch.float, torch.double, torch.half, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
                torch.int32, torch.int64, torch.bool]


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor that exists on one rank only (``None`` elsewhere) on every rank (its shape need not be known)."""
    if not is_distributed():
        if tensor is None:
            raise ValueError("copy_tensor_to_devices(None) on one process: there is no tensor to copy; pass one")
        return tensor
    info = [None if tensor is None else (tuple(tensor.shape), _DTYPE_CODES.index(tensor.dtype))]
    everyone: list[tuple[tuple[int, ...], int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, info[0])
    shape, code = next(i for i in everyone if i is not None)
    if tensor is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.zeros(shape, dtype=_DTYPE_CODES[code], device=device)
    return reduce(tensor, reduction="sum")


__all__ = ["CannotPadNestedTensorWarning", "ConvertOutputsToFp32", "DistributedOperationException",
           "TensorInformation", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32", "copy_tensor_to_devices",
           "find_batch_size", "find_device", "get_data_structure", "honor_type", "ignorant_find_batch_size",
           "initialize_tensors", "is_namedtuple", "is_tensor_information", "is_torch_tensor", "listify",
           "pad_input_tensors", "slice_tensors"]
