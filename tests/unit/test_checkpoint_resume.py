"""Exact resume on one process: an interrupted run, resumed, ends bitwise where the uninterrupted one does."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from checkpoint_helpers import (
    assert_bitwise_equal,
    first_half,
    make_run,
    masking_run,
    resumed,
    train,
    uninterrupted,
)
from helpers import IndexDataset, make_mlp, make_regression
from impel import Accelerator, DataLoaderConfiguration, ProjectConfiguration
from impel.runtime.ranks.process import ProcessState


def test_twenty_steps_equal_ten_saved_then_ten_resumed_bitwise(tmp_path):
    reference = uninterrupted(20)
    ProcessState._reset()
    first_half(str(tmp_path), 10, save_at=[10])
    ProcessState._reset()
    result = resumed(str(tmp_path), 20)
    assert result["loaded"].endswith("checkpoint_0")
    assert_bitwise_equal(result, reference)


def test_python_and_numpy_rng_continue_where_they_were(tmp_path):
    acc, _model, _opt, _loader, _sched = make_run(None)
    random.seed(5)
    np.random.seed(5)
    acc.save_state(tmp_path / "ckpt")
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    acc.load_state(tmp_path / "ckpt")
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def _batches(loader, count):
    out = []
    while len(out) < count:
        for batch in loader:
            out.append(batch.flatten().tolist())
            if len(out) == count:
                break
    return out


@pytest.mark.parametrize("seedable", [True, False])
def test_dataloader_continues_with_the_next_unseen_batch_and_later_epochs_shuffle_as_before(tmp_path, seedable):
    config = DataLoaderConfiguration(use_seedable_sampler=seedable)

    def loader_for(seed):
        acc = Accelerator(cpu=True, dataloader_config=config)
        torch.manual_seed(seed)
        return acc, acc.prepare(DataLoader(IndexDataset(10), batch_size=3, shuffle=True))

    _, ref_loader = loader_for(0)
    reference = _batches(ref_loader, 10)  # 4 batches per epoch: 2.5 epochs
    ProcessState._reset()
    acc, loader = loader_for(0)
    assert _batches(loader, 6) == reference[:6]  # stops inside epoch 1
    acc.save_state(tmp_path / "ckpt")
    ProcessState._reset()
    acc, loader = loader_for(77)
    acc.load_state(tmp_path / "ckpt")
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 2
    assert _batches(loader, 4) == reference[6:]


def test_counters_scheduler_and_step_are_restored(tmp_path):
    acc, model, opt, loader, sched = make_run(None)
    train(acc, model, opt, loader, sched, 7)
    step, lr, taken = acc.step, sched.get_last_lr(), opt.steps_taken
    acc.save_state(tmp_path / "ckpt")
    ProcessState._reset()
    acc2, _model2, opt2, loader2, sched2 = make_run(None, seed=3)
    acc2.load_state(tmp_path / "ckpt")
    assert (acc2.step, sched2.get_last_lr(), opt2.steps_taken) == (step, lr, taken)
    assert loader2.state_dict()["position"] == loader.state_dict()["position"]


def test_saving_before_the_first_step_leaves_adam_untouched(tmp_path):
    acc, _model, opt, _loader, _sched = make_run(None)
    acc.save_state(tmp_path / "ckpt")
    assert len(opt.state) == 0  # get_optimizer_state_dict initialises state; impel undoes it
    acc.load_state(tmp_path / "ckpt")
    assert len(opt.state) == 0


def _fp16_run():
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return (acc, *acc.prepare(model, opt))


def test_fp16_grad_scaler_state_round_trips(tmp_path):
    acc, model, opt = _fp16_run()
    x, y = make_regression(8).tensors
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    acc.scaler.update(1024.0)
    acc.save_state(tmp_path / "ckpt")
    saved = acc.scaler.state_dict()
    ProcessState._reset()
    acc2, _, _ = _fp16_run()
    acc2.load_state(tmp_path / "ckpt")
    assert acc2.scaler.state_dict() == saved and acc2.scaler.get_scale() == 1024.0


def test_accumulation_position_inside_a_group_is_restored(tmp_path):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_regression(40), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    for i, (x, y) in enumerate(loader):
        acc.backward(nn.functional.mse_loss(model(x), y))
        if i == 1:
            break
    acc.save_state(tmp_path / "ckpt")
    acc.gradient_state.load_state_dict({"micro_in_group": 0})
    acc.load_state(tmp_path / "ckpt")
    assert acc.gradient_state.micro_in_group == 2


def test_project_dir_argument_and_save_iteration(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path, project_config=ProjectConfiguration(
        automatic_checkpoint_naming=True))
    assert acc.project_dir == str(tmp_path) and acc.logging_dir == str(tmp_path)
    assert acc.save_iteration == 0
    acc.prepare(torch.nn.Linear(2, 2))  # something to save (save_state before prepare raises)
    assert acc.save_state().endswith("checkpoint_0")
    assert acc.save_iteration == 1


@pytest.mark.parametrize("seedable", [True, False])
@pytest.mark.parametrize("mode", ["skip", "position"])
def test_a_collator_drawing_random_masks_resumes_exactly(tmp_path, mode, seedable):
    """The batch after the save was fetched (one batch of look-ahead) before the save, drawing its masks from the
    global RNG: the resumed run fetches it again from the RNG state it had then (saved per rank), so every later
    batch, dropout mask and weight is the uninterrupted run's."""
    seen, weights = masking_run(str(tmp_path), "full", seedable)
    ProcessState._reset()
    resumed_seen, resumed_weights = masking_run(str(tmp_path), mode, seedable)
    assert len(resumed_seen) == len(seen) - 3
    assert resumed_seen == seen[3:] and resumed_weights == weights
