"""LocalSGD on one process (a no-op, as in Accelerate), its argument checks and the strategies it refuses. Its
numbers on 2 ranks are compared with Accelerate in tests/multiprocess/test_local_sgd_matches_accelerate.py."""
from __future__ import annotations

import pytest
import torch

from impel import Accelerator, FullyShardedDataParallelPlugin
from impel.accelerator.local_sgd import LocalSGD


def test_one_process_counts_steps_and_changes_nothing():
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2) as local_sgd:
        assert local_sgd.enabled is False
        for _ in range(4):
            local_sgd.step()
    assert local_sgd.num_steps == 4
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("steps", [0, -3, None, 2.0, True])
def test_local_sgd_steps_must_be_a_positive_int_when_enabled(steps):
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError,
                       match=rf"LocalSGD\(local_sgd_steps={steps!r}\) must be a positive int.*enabled=False"):
        LocalSGD(acc, torch.nn.Linear(2, 2), steps)
    LocalSGD(acc, torch.nn.Linear(2, 2), steps, enabled=False)  # Accelerate's example: local_sgd_steps=None, off


def test_a_sharded_strategy_is_refused():
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(NotImplementedError, match="distributed_type='FSDP' shards the parameters.*DDP"):
        LocalSGD(acc, torch.nn.Linear(2, 2), 4)
