"""Context parallel off the GPU: the no-op path (cp off), and the refusal on CPU naming torch's limit and the fix.

Real device meshes in one process: torch's "fake" process group plays a world of 4 ranks without any
communication (nothing here communicates: the no-op path never enters torch's context_parallel, the CPU path is
refused before it). The CUDA run, CP=2 against unsplit attention, is tests/gpu/test_cuda_context_parallel.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.functional import scaled_dot_product_attention

from impel.config.run_config import ConfigError
from impel.runtime.step.context_parallel import _check_buffers, comm_strategy, context_parallel, cp_mesh


@pytest.fixture
def world_of_4():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield lambda shape, names: init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def _attention_and_buffers():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    return q, k, v, scaled_dot_product_attention(q, k, v, is_causal=True)


def test_no_cp_dimension_is_a_no_op(world_of_4):
    """No mesh, a mesh without "cp", a cp of size 1: the buffers keep their whole sequence and SDPA is torch's."""
    q, k, v, want = _attention_and_buffers()
    for mesh in (None, world_of_4((2, 2), ("dp_shard", "tp")), world_of_4((4, 1), ("dp_shard", "cp"))):
        with context_parallel(mesh, [q, k, v], [2, 2, 2], no_restore_buffers={q}, cp_comm_strategy="alltoall"):
            assert q.shape == (1, 2, 8, 4)
            assert torch.equal(scaled_dot_product_attention(q, k, v, is_causal=True), want)
    with context_parallel(None):  # what Accelerator.maybe_context_parallel() does with no arguments and cp off
        pass


def test_cp_on_cpu_is_refused_naming_torchs_limit_and_the_fix(world_of_4):
    q, k, v, _ = _attention_and_buffers()
    for mesh in (world_of_4((2, 2), ("dp_shard", "cp")), world_of_4((4,), ("cp",))):
        with pytest.raises(ConfigError, match=r"cp_size \d: the cp mesh is on 'cpu'.*no CPU sharding rule for "
                                              r"scaled_dot_product_attention.*CUDA only\. Set cp_size 1"):
            with context_parallel(mesh, [q, k, v], [2, 2, 2]):
                pytest.fail("entered context parallel on CPU")
        assert q.shape == (1, 2, 8, 4)  # nothing was split


def test_the_cp_sub_mesh_is_found_by_name(world_of_4):
    mesh = world_of_4((2, 2), ("dp_shard", "cp"))
    assert cp_mesh(mesh).mesh_dim_names == ("cp",) and cp_mesh(mesh).size() == 2
    assert cp_mesh(mesh["cp"]).mesh_dim_names == ("cp",)
    with pytest.raises(ConfigError, match="without dimension names: pass its 'cp' sub-mesh"):
        cp_mesh(world_of_4((2, 2), None))


def test_comm_strategy_takes_accelerates_names_or_its_handler():
    from accelerate.utils import TorchContextParallelConfig

    assert comm_strategy(None) == "allgather" and comm_strategy("alltoall") == "alltoall"
    assert comm_strategy(TorchContextParallelConfig(cp_comm_strategy="alltoall")) == "alltoall"
    with pytest.raises(ConfigError, match="cp_comm_strategy 'ring' is not one of allgather, alltoall"):
        comm_strategy("ring")
    with pytest.raises(ConfigError, match="is not one of"):  # checked even when cp is off: a typo fails at once
        with context_parallel(None, cp_comm_strategy="all_gather"):
            pass


def test_buffers_are_checked_before_torch_splits_them(world_of_4):
    mesh = world_of_4((4,), ("cp",))
    q = torch.zeros(1, 2, 10, 4)
    with pytest.raises(ConfigError, match="sequence length 10 .*not divisible by cp_size 4: pad the sequence to a "
                                          "multiple of 8"):
        _check_buffers(mesh, [q], [2], set())
    with pytest.raises(ConfigError, match="needs buffers"):
        _check_buffers(mesh, [], [], set())
    with pytest.raises(ConfigError, match="1 buffers but 2 buffer_seq_dims"):
        _check_buffers(mesh, [q], [2, 1], set())
    with pytest.raises(ConfigError, match="subset of buffers"):
        _check_buffers(mesh, [q], [2], {torch.zeros(1)})


def test_the_accelerator_s_maybe_context_parallel_is_a_no_op_without_a_cp_dimension():
    import torch

    from impel import Accelerator

    acc = Accelerator(cpu=True)
    ids = torch.arange(8).reshape(1, 8)
    with acc.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}):
        assert ids.shape == (1, 8)  # nothing split: no parallelism_config, no cp mesh
    assert ids.tolist() == [list(range(8))]
