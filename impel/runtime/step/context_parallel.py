"""Context parallelism: the sequence split over the "cp" ranks of the device mesh, attention computed as a ring.

``context_parallel(mesh, buffers, buffer_seq_dims, no_restore_buffers, cp_comm_strategy)`` is a context manager
around torch's ``torch.distributed.tensor.experimental.context_parallel``: inside it every buffer (inputs, labels,
position ids) holds this rank's part of the sequence (load-balanced head and tail chunks) and
``scaled_dot_product_attention`` exchanges keys and values with the other cp ranks, by ``cp_comm_strategy``:
"allgather" (the default, gathers them after the first block) or "alltoall" (rotates them), Accelerate's names in
``TorchContextParallelConfig``. On exit the buffers get their full sequence back, except ``no_restore_buffers``.
Recreate it for every step, as Accelerate's ``maybe_context_parallel``.

With no cp dimension (``mesh`` None, a mesh without a "cp" dimension, or cp of size 1) it does nothing, so a training
loop can call it unconditionally; ``Accelerator.maybe_context_parallel`` is one line over it::

    return context_parallel(self.torch_device_mesh, buffers, buffer_seq_dims, no_restore_buffers,
                            getattr(self.parallelism_config, "cp_handler", None))

torch has a sharding rule for SDPA under context parallel only for the CUDA kernels (flash, memory-efficient,
cuDNN): on CPU torch 2.13 fails inside attention with "Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered". A cp mesh that is not on CUDA is refused on entry with that
limit and the fix (cp_size 1) instead.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from impel.config.schema import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

CP_COMM_STRATEGIES = ("allgather", "alltoall")
CPU_LIMIT = ("torch's context_parallel has no CPU sharding rule for scaled_dot_product_attention (on CPU it fails "
             "with 'aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
             "registered'): context parallelism runs on CUDA only")


def comm_strategy(value: object = None) -> str:
    """The rotate method: a name, a handler carrying ``cp_comm_strategy`` (Accelerate's TorchContextParallelConfig),
    or None (Accelerate's default, "allgather")."""
    name = getattr(value, "cp_comm_strategy", value)
    name = "allgather" if name is None else name
    if name not in CP_COMM_STRATEGIES:
        raise ConfigError(f"cp_comm_strategy {name!r} is not one of {', '.join(CP_COMM_STRATEGIES)} (how context "
                          "parallel attention exchanges keys and values: 'allgather' gathers them, 'alltoall' "
                          "rotates them)")
    return name


def cp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The "cp" sub-mesh of ``mesh`` (``mesh`` itself when it is a 1-D mesh named "cp" or unnamed); None when
    context parallel is off: no mesh, a mesh without a "cp" dimension, or a cp dimension of size 1."""
    if mesh is None:
        return None
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "cp" in names and names != ("cp",):
        mesh = mesh["cp"]
    elif names and names != ("cp",):
        return None
    elif not names and mesh.ndim != 1:
        raise ConfigError(f"context_parallel got a {mesh.ndim}-D device mesh without dimension names: pass its 'cp' "
                          "sub-mesh, or build it with mesh_dim_names (e.g. ('dp_shard', 'cp'))")
    return mesh if mesh.size() > 1 else None


def check_device(mesh: DeviceMesh) -> None:
    """Refuse a cp mesh torch cannot run attention on, naming torch's limit and the fix."""
    import torch

    device = getattr(mesh, "device_type", None)
    if device != "cuda" or not torch.cuda.is_available():
        where = f"the cp mesh is on {device!r}" + ("" if torch.cuda.is_available() else " and torch sees no CUDA")
        raise ConfigError(f"cp_size {mesh.size()}: {where}; {CPU_LIMIT}. Set cp_size 1 (parallelism_config_cp_size "
                          "1) to train on CPU, or run on CUDA devices")


def _check_buffers(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                   no_restore: set[torch.Tensor]) -> None:
    if not buffers:
        raise ConfigError("context_parallel needs buffers to split over the sequence (input_ids, labels, ...) and "
                          "buffer_seq_dims giving each one's sequence dimension; none were passed")
    if len(buffers) != len(seq_dims):
        raise ConfigError(f"{len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims: give one sequence dimension "
                          "per buffer")
    if any(not any(b is buf for buf in buffers) for b in no_restore):
        raise ConfigError("no_restore_buffers must be a subset of buffers (the same tensor objects)")
    size = mesh.size()
    for i, (buf, dim) in enumerate(zip(buffers, seq_dims)):
        length = buf.shape[dim]
        if length % size:
            raise ConfigError(f"buffer {i} has sequence length {length} (dim {dim}), not divisible by cp_size {size}: "
                              f"pad the sequence to a multiple of {2 * size} (torch balances the load with "
                              f"2 x cp_size chunks)")


@contextmanager
def context_parallel(mesh: DeviceMesh | None, buffers: Sequence[torch.Tensor] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None, no_restore_buffers: set[torch.Tensor] | None = None,
                     cp_comm_strategy: object = None) -> Iterator[None]:
    """Split ``buffers`` along ``buffer_seq_dims`` over the cp ranks and run SDPA as ring attention inside; a
    no-op when ``mesh`` has no cp dimension larger than 1 (see the module docstring)."""
    strategy = comm_strategy(cp_comm_strategy)
    mesh = cp_mesh(mesh)
    if mesh is None:
        yield
        return
    check_device(mesh)
    buffers = list(buffers or [])
    seq_dims = list(buffer_seq_dims or [])
    no_restore = set(no_restore_buffers or ())
    _check_buffers(mesh, buffers, seq_dims, no_restore)
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(strategy)  # a process-wide setting in torch: set on every entry, as each context may differ
    with torch_context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=no_restore):
        yield
