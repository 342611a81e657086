"""API misuse that used to pass silently or end in a raw torch error: each gives Accelerate's result or one message
naming the cause and the fix (issue 27's round-2 cases A2, A8, D1, D6, K7)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from impel import Accelerator
from impel.checkpoint import CheckpointError

CLIP_BEFORE_BACKWARD = textwrap.dedent("""
    import json, os, sys, torch
    os.environ["ACCELERATE_USE_CPU"] = "1"
    if sys.argv[1] == "accelerate":
        from accelerate import Accelerator
    else:
        from impel import Accelerator
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = acc.clip_grad_norm_(model.parameters(), 1.0)
    print(json.dumps({"norm": float(before), "grads": [p.grad is None for p in model.parameters()]}))
""")


def _clip_before_backward(library: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CLIP_BEFORE_BACKWARD, library], capture_output=True, text=True,
                         timeout=240, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fp16_clip_grad_norm_before_any_backward_returns_zero_as_accelerate():
    ours = _clip_before_backward("impel")
    assert ours == {"norm": 0.0, "grads": [True, True]}  # torch's GradScaler asserted "_scale is None" here
    pytest.importorskip("accelerate")
    assert _clip_before_backward("accelerate") == ours


def test_fp16_clip_before_backward_leaves_the_next_step_as_it_was():
    def run(clip_first: bool) -> list[torch.Tensor]:
        acc = Accelerator(cpu=True, mixed_precision="fp16")
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        if clip_first:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        for _ in range(3):
            acc.backward(model(torch.full((2, 3), 1e-3)).sum())
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_save_state_before_prepare_names_the_fix(tmp_path):
    acc = Accelerator(cpu=True)
    with pytest.raises(CheckpointError, match=r"save_state\(\) before prepare\(\): no model, optimizer, scheduler or "
                                              r"dataloader is prepared .* call accelerator.prepare\(model, "):
        acc.save_state(str(tmp_path / "ckpt"))
    assert list(tmp_path.iterdir()) == []  # nothing written
    acc.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.ones(1))],
                                                                                   lr=0.1), 1))
    assert acc.save_state(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt")  # a registered object is enough


def test_a_file_given_as_the_checkpoint_directory_is_named_as_a_file(tmp_path):
    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(2, 2))
    saved = acc.save_state(str(tmp_path / "ckpt"))
    weights = os.path.join(saved, "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        acc.load_state(weights)
    assert str(info.value) == (f"{weights} is a file, not a checkpoint directory; pass the directory save_state() "
                               f"wrote (the one holding this file: {saved})")


@pytest.mark.parametrize("samples, batch_size, drop_last", [(0, 4, False), (1, 4, True), (5, 8, True)])
def test_a_loader_that_yields_no_batch_warns_with_its_sizes(samples, batch_size, drop_last):
    acc = Accelerator(cpu=True)
    data = TensorDataset(torch.zeros(samples, 2))
    loader = acc.prepare(DataLoader(data, batch_size=batch_size, drop_last=drop_last))
    with pytest.warns(UserWarning) as caught:
        assert list(loader) == []
    assert str(caught[0].message) == (
        f"a prepared DataLoader gave this rank no batch: its dataset has {samples} samples, batch_size={batch_size} "
        f"per process on 1 process(es), drop_last={drop_last}; the loop runs no step: check the dataset, or lower "
        "batch_size / drop_last=False")


def test_a_loader_with_batches_does_not_warn_nor_one_that_leaves_a_rank_empty_on_purpose():
    from impel.runtime.loaders.data import DataLoaderShard, ShardSampler

    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(TensorDataset(torch.zeros(3, 2)), batch_size=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(loader)) == 1
        # rank 1 of 2 with even_batches=False: rank 0 holds the 3 samples, so nothing is wrong
        data = TensorDataset(torch.zeros(3, 2))
        base = DataLoader(data, batch_size=4)
        shard = ShardSampler(base.sampler, 4, 2, 1, False, even_batches=False)
        rank1 = DataLoaderShard.build(DataLoader(data, batch_sampler=shard), shard, None, False, acc.gradient_state, 4,
                                      base)
        assert list(rank1) == []
