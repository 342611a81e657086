"""end_of_dataloader, accumulation groups and the loss divisor, alone and through a real Accelerator loop."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from helpers import IndexDataset, make_mlp, make_regression, max_abs_diff
from impel import Accelerator, DataLoaderConfiguration, GradientAccumulationPlugin
from impel.config.run_config import ConfigError
from impel.runtime.loaders.data import shard_dataloader
from impel.runtime.step.accumulation import GradientState


def prepared(n: int, batch_size: int, plugin: GradientAccumulationPlugin | None = None, world: int = 1,
             rank: int = 0):
    gs = GradientState(plugin or GradientAccumulationPlugin())
    dl = shard_dataloader(DataLoader(IndexDataset(n), batch_size=batch_size), world=world, rank=rank, device=None,
                          config=DataLoaderConfiguration(), gradient_state=gs)
    return dl, gs


# --- end_of_dataloader --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,batch_size,world", [(10, 1, 1), (10, 3, 1), (11, 2, 2), (1, 4, 1), (4, 4, 1)])
def test_end_of_dataloader_is_true_exactly_on_the_last_batch(n, batch_size, world):
    dl, gs = prepared(n, batch_size, world=world)
    flags = []
    for _ in dl:
        assert gs.active_dataloader is dl
        assert gs.end_of_dataloader == dl.end_of_dataloader
        flags.append(dl.end_of_dataloader)
    assert flags == [False] * (len(flags) - 1) + [True]
    assert len(flags) == len(dl)
    assert not dl.end_of_dataloader and not gs.end_of_dataloader
    assert gs.active_dataloader is None


def test_end_of_dataloader_is_reset_when_the_loop_breaks():
    dl, gs = prepared(10, 2)
    for i, _ in enumerate(dl):
        if i == 4:
            assert dl.end_of_dataloader
            break
    assert not dl.end_of_dataloader
    assert gs.active_dataloaders == ()
    for i, _ in enumerate(dl):
        if i == 2:
            break
    assert not dl.end_of_dataloader and gs.active_dataloaders == ()


def test_nested_dataloaders_report_the_innermost():
    gs = GradientState(GradientAccumulationPlugin())
    make = lambda n: shard_dataloader(DataLoader(IndexDataset(n), batch_size=1), world=1, rank=0,  # noqa: E731
                                      device=None, config=DataLoaderConfiguration(), gradient_state=gs)
    outer, inner = make(2), make(3)
    for _ in outer:
        for _ in inner:
            assert gs.active_dataloader is inner
            assert gs.end_of_dataloader == inner.end_of_dataloader
        assert gs.active_dataloader is outer
        assert gs.end_of_dataloader == outer.end_of_dataloader


def test_gradient_state_remainder_is_set_only_on_the_last_batch():
    dl, gs = prepared(11, 4, world=2)
    seen = [gs.remainder for _ in dl]
    assert seen == [-1, 3]
    assert gs.remainder == -1


def test_remaining_batches_counts_the_batch_in_use():
    dl, _ = prepared(10, 1)
    assert [dl.remaining_batches() for _ in dl] == list(range(10, 0, -1))


def test_remaining_batches_after_skipping():
    dl, _ = prepared(10, 1)
    dl.skip_batches(3)
    assert [dl.remaining_batches() for _ in dl] == list(range(7, 0, -1))


# --- groups and divisors (GradientState alone) --------------------------------------------------------------------

@pytest.mark.parametrize("divisor", ["nominal", "actual"])
@pytest.mark.parametrize("batches,steps,groups", [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 4, [3]), (7, 3, [3, 3, 1]),
                                                 (5, 1, [1, 1, 1, 1, 1])])
def test_accumulation_groups_follow_the_dataloader(batches, steps, groups, divisor):
    """Groups end with the dataloader; the loss divisor is num_steps (Accelerate's), or with
    short_group_divisor="actual" the group's real length."""
    dl, gs = prepared(batches, 1, GradientAccumulationPlugin(num_steps=steps, short_group_divisor=divisor))
    syncs, divisors = [], []
    for _ in range(2):  # two epochs: the bookkeeping restarts cleanly
        for _ in dl:
            gs.begin()
            syncs.append(gs.sync_gradients)
            divisors.append(gs.loss_divisor)
    expected_syncs = sum(([False] * (g - 1) + [True] for g in groups), [])
    expected_divisors = sum(([g if divisor == "actual" else steps] * g for g in groups), [])
    assert syncs == expected_syncs * 2
    assert divisors == expected_divisors * 2


def test_without_sync_with_dataloader_groups_run_across_epochs():
    dl, gs = prepared(10, 1, GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False))
    syncs = []
    for _ in range(2):
        for _ in dl:
            gs.begin()
            syncs.append(gs.sync_gradients)
            assert gs.loss_divisor == 4
    assert [i + 1 for i, s in enumerate(syncs) if s] == [4, 8, 12, 16, 20]


def test_without_a_dataloader_groups_are_num_steps_long():
    gs = GradientState(GradientAccumulationPlugin(num_steps=3))
    syncs = []
    for _ in range(7):
        gs.begin()
        syncs.append(gs.sync_gradients)
    assert syncs == [False, False, True, False, False, True, False]


class SizedIterable(IterableDataset):
    def __init__(self, data) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data[0])

    def __iter__(self):
        yield from zip(*self.data)


# --- through the Accelerator --------------------------------------------------------------------------------------

LR = 0.05


def reference_groups(model: nn.Module, dataset, batch_size: int, groups: list[int],
                     divisor: int | None = None) -> dict[str, torch.Tensor]:
    """Hand-written accumulation: each group's losses divided by the group's length (or ``divisor``), one optimizer
    (and scheduler) step per group."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batches = list(DataLoader(dataset, batch_size=batch_size, shuffle=False))
    i = 0
    for g in groups:
        for _ in range(g):
            x, y = batches[i % len(batches)]
            (nn.functional.mse_loss(model(x), y) / (divisor or g)).backward()
            i += 1
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accelerated_run(loop: str, epochs: int = 1, n: int = 40, batch_size: int = 4, steps: int = 4,
                    dataset=None, divisor: str = "actual"):
    plugin = GradientAccumulationPlugin(num_steps=steps, short_group_divisor=divisor)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    real_steps = []
    opt.register_step_post_hook(lambda *_: real_steps.append(1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(dataset if dataset is not None else make_regression(n), batch_size=batch_size)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    divisors, ends = [], []
    for _ in range(epochs):
        for x, y in loader:
            ctx = acc.accumulate(model) if loop == "accumulate" else contextlib.nullcontext()
            with ctx:
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                divisors.append(acc.gradient_state.loss_divisor)
                ends.append(loader.end_of_dataloader)
                opt.step()
                sched.step()
                opt.zero_grad()
    params = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return params, len(real_steps), opt, sched, divisors, ends


@pytest.mark.parametrize("loop", ["accumulate", "automatic"])
def test_accelerator_accumulates_groups_of_4_4_2(loop):
    params, real_steps, opt, sched, divisors, ends = accelerated_run(loop)
    assert real_steps == 3
    assert opt.steps_taken == 3
    assert divisors == [4] * 8 + [2] * 2
    assert ends == [False] * 9 + [True]
    assert sched.get_last_lr() == [pytest.approx(LR * 0.5 ** 3)]
    reference = reference_groups(make_mlp(), make_regression(40), 4, [4, 4, 2])
    assert max_abs_diff(params, reference) < 1e-6
    # and it is not simply equal to a wrong answer (groups of 4 with the last one divided by 4)
    wrong = reference_groups(make_mlp(), make_regression(40), 4, [4, 4, 4])
    assert max_abs_diff(params, wrong) > 1e-4


@pytest.mark.parametrize("loop", ["accumulate", "automatic"])
def test_by_default_the_short_group_divides_by_the_nominal_steps_as_accelerate(loop):
    """Accelerate's numbers (compared with Accelerate itself in test_short_group_matches_accelerate.py)."""
    params, real_steps, _, _, divisors, _ = accelerated_run(loop, divisor="nominal")
    assert real_steps == 3 and divisors == [4] * 10
    reference = reference_groups(make_mlp(), make_regression(40), 4, [4, 4, 2], divisor=4)
    assert max_abs_diff(params, reference) < 1e-6
    assert Accelerator().gradient_state.plugin.short_group_divisor == "nominal"


@pytest.mark.parametrize("loop", ["accumulate", "automatic"])
def test_accelerator_accumulation_over_two_epochs(loop):
    params, real_steps, *_ = accelerated_run(loop, epochs=2)
    assert real_steps == 6
    reference = reference_groups(make_mlp(), make_regression(40), 4, [4, 4, 2, 4, 4, 2])
    assert max_abs_diff(params, reference) < 1e-6


def test_accelerator_accumulation_with_a_sized_iterable_dataset():
    data = make_regression(40).tensors
    params, real_steps, _, _, divisors, _ = accelerated_run("automatic", dataset=SizedIterable(data))
    assert real_steps == 3
    assert divisors == [4] * 8 + [2] * 2
    reference = reference_groups(make_mlp(), make_regression(40), 4, [4, 4, 2])
    assert max_abs_diff(params, reference) < 1e-6


class UnsizedIterable(SizedIterable):
    __len__ = None  # type: ignore[assignment]  # len() raises TypeError: the loader cannot count its batches


def test_an_unsized_iterable_dataset_syncs_its_short_last_group_at_the_end():
    """Without a length the group sizes are not known ahead: groups are num_steps long (loss divided by 4), and
    the last batch of the epoch still ends its short group: the optimizer steps there."""
    data = make_regression(40).tensors
    params, real_steps, _, _, divisors, ends = accelerated_run("automatic", dataset=UnsizedIterable(data))
    assert ends == [False] * 9 + [True]
    assert real_steps == 3 and divisors == [4] * 10
    reference = reference_groups(make_mlp(), make_regression(40), 4, [4, 4, 2], divisor=4)
    assert max_abs_diff(params, reference) < 1e-6


def test_accelerator_without_accumulation_steps_every_batch():
    params, real_steps, _, _, divisors, _ = accelerated_run("automatic", steps=1)
    assert real_steps == 10
    reference = reference_groups(make_mlp(), make_regression(40), 4, [1] * 10)
    assert max_abs_diff(params, reference) < 1e-6


def test_accelerator_sync_gradients_flag_during_the_loop():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(40), batch_size=4))
    flags = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            flags.append(acc.sync_gradients)
    assert [i + 1 for i, f in enumerate(flags) if f] == [4, 8, 10]


def test_accelerator_step_counts_micro_steps_and_restarts_with_each_epoch():
    """Accelerate's ``accelerator.step`` (the default step of ``accelerator.log``): micro-steps begun, back to 0 on
    the batch that ends the dataloader."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(40), batch_size=4))
    seen = []
    for _ in range(2):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                seen.append(acc.step)
    assert seen == [*range(1, 10), 0] * 2


def test_eval_forward_does_not_open_a_micro_step():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(3, 6)
    with torch.no_grad():
        for _ in range(5):
            model(x)
    assert acc.gradient_state.micro_in_group == 0
    acc.backward(model(x).sum())
    assert not acc.sync_gradients
    acc.backward(model(x).sum())
    assert acc.sync_gradients


def test_direct_loss_backward_still_ends_micro_steps_and_warns(caplog):
    """A loop that calls loss.backward() itself keeps its accumulation groups and is told about the loss scale."""
    import logging

    from impel import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    syncs = []
    with caplog.at_level(logging.WARNING, logger="impel"):
        for _ in range(4):
            model(torch.ones(1, 2)).sum().backward()
            syncs.append(acc.sync_gradients)
            opt.step()
            opt.zero_grad()
    assert syncs == [False, True, False, True]
    assert sum("accelerator.backward(loss)" in r.getMessage() for r in caplog.records) == 1


def test_a_plugin_without_num_steps_takes_the_launched_steps(monkeypatch):
    """A plugin without num_steps (short_group_divisor="actual") leaves the steps to the launch or the environment."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=None,
                                                                              short_group_divisor="actual"))
    assert acc.gradient_accumulation_steps == 3 and acc.gradient_state.plugin.short_group_divisor == "actual"
    with pytest.raises(ConfigError, match=r"short_group_divisor='mean'\) must be 'nominal'"):
        GradientAccumulationPlugin(short_group_divisor="mean")


def test_the_gradient_state_changes_only_through_its_methods():
    gs = GradientState(GradientAccumulationPlugin(num_steps=2))
    for name in ("sync_gradients", "num_steps", "micro_in_group", "step", "group_size"):
        with pytest.raises(AttributeError):
            setattr(gs, name, 1)
    gs.set_sync_gradients(False)
    assert gs.sync_gradients is False
    gs.begin()
    assert gs.micro_in_group == 1
    with pytest.raises(ConfigError, match="middle of an accumulation group"):
        gs.set_accumulation_steps(4)
    with gs.no_sync_block():
        assert gs.manual_no_sync and not gs.grad_sync_enabled
    assert not gs.manual_no_sync


def test_gradient_state_without_a_plugin_is_the_newest_accelerators_as_in_accelerate():
    import copy
    import pickle

    from impel import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=3)
    shared = GradientState()
    assert shared is acc.gradient_state and shared.num_steps == 3
    assert GradientState().plugin_kwargs == {"num_steps": 3}
    clone = pickle.loads(pickle.dumps(acc.gradient_state))
    assert clone is not acc.gradient_state and clone.num_steps == 3 and clone.state_dict() == shared.state_dict()
    assert copy.deepcopy(acc.gradient_state).num_steps == 3
