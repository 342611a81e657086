"""Single-process behaviour of split_between_processes, print, on_*_process, collectives and set_seed."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from impel import Accelerator, ConfigError, set_seed
from impel.config.environment import Topology
from impel.runtime.ranks.splitting import split_for_rank


def pretend_rank(acc: Accelerator, rank: int, world: int = 2) -> None:
    """Make the (shared) process state claim another rank, without a process group (the fixture resets it)."""
    acc.state.topology = Topology(rank=rank, world_size=world, local_rank=rank, local_world_size=world)


@pytest.mark.parametrize("inputs", [[1, 2, 3, 4, 5], ("a", "b", "c"), torch.arange(7), [],
                                    {"x": [1, 2, 3], "y": ["a", "b", "c"]}])
@pytest.mark.parametrize("apply_padding", [False, True])
def test_split_between_processes_on_one_process_returns_everything(inputs, apply_padding):
    acc = Accelerator(cpu=True)
    with acc.split_between_processes(inputs, apply_padding=apply_padding) as mine:
        if isinstance(inputs, torch.Tensor):
            assert torch.equal(mine, inputs)
        else:
            assert mine == inputs
            assert type(mine) is type(inputs)


def test_split_for_rank_gives_contiguous_shares():
    data = list(range(7))
    shares = [split_for_rank(data, 3, r) for r in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]
    padded = [split_for_rank(data, 3, r, apply_padding=True) for r in range(3)]
    assert padded == [[0, 1, 2], [3, 4, 6], [5, 6, 6]]


def test_split_between_processes_rejects_bad_input():
    acc = Accelerator(cpu=True)
    with pytest.raises(ConfigError, match="different lengths"):
        with acc.split_between_processes({"a": [1, 2], "b": [1]}):
            pass
    with pytest.raises(ConfigError, match="set"):
        with acc.split_between_processes({1, 2}):
            pass


def test_print_prints_on_the_main_process_only(capsys):
    acc = Accelerator(cpu=True)
    acc.print("hello", 3, sep="-")
    assert capsys.readouterr().out == "hello-3\n"
    pretend_rank(acc, 1)
    assert not acc.is_main_process
    acc.print("hidden")
    assert capsys.readouterr().out == ""
    pretend_rank(acc, 0)
    acc.print("back")
    assert capsys.readouterr().out == "back\n"


def test_on_process_decorators():
    acc = Accelerator(cpu=True)
    calls = []
    main = acc.on_main_process(lambda: calls.append("main") or "m")
    last = acc.on_last_process(lambda: calls.append("last"))
    second = acc.on_process(process_index=1)(lambda: calls.append("second"))
    assert main() == "m"
    last()
    second()
    assert calls == ["main", "last"]
    pretend_rank(acc, 1)
    calls.clear()
    assert main() is None
    last()
    second()
    assert calls == ["last", "second"]
    with pytest.raises(ConfigError, match="process_index"):
        acc.on_process(lambda: None)


def test_main_process_first_runs_the_body_once():
    acc = Accelerator(cpu=True)
    ran = []
    with acc.main_process_first():
        ran.append(1)
    with acc.local_main_process_first():
        ran.append(2)
    acc.wait_for_everyone()
    assert ran == [1, 2]


def test_collectives_on_one_process_are_copies():
    acc = Accelerator(cpu=True)
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(acc.gather(t), t)
    assert torch.equal(acc.gather(torch.tensor(3.0)), torch.tensor([3.0]))
    assert torch.equal(acc.reduce(t, "mean"), t)
    assert torch.equal(acc.reduce(t, "sum", scale=2.0), 2 * t)
    assert torch.equal(acc.pad_across_processes(t), t)
    assert torch.equal(acc.broadcast(t), t)
    assert acc.broadcast_object_list([1, "a"]) == [1, "a"]
    nested = acc.gather({"a": t, "b": [t, t]})
    assert torch.equal(nested["a"], t) and len(nested["b"]) == 2
    assert torch.equal(acc.reduce(t, "max"), t) and torch.equal(acc.reduce(t, "min"), t)
    with pytest.raises(ValueError, match="'prod'"):
        acc.reduce(t, "prod")


def test_gather_for_metrics_on_one_process_keeps_every_sample():
    from torch.utils.data import DataLoader

    from helpers import IndexDataset

    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(IndexDataset(10), batch_size=4))
    seen = []
    for batch in loader:
        seen.append(acc.gather_for_metrics(batch))
    assert torch.cat(seen).flatten().tolist() == list(range(10))
    assert acc.gather_for_metrics(["x", "y"], use_gather_object=True) == ["x", "y"]


def test_set_seed_makes_random_draws_reproducible():
    def draw():
        return torch.rand(5), torch.randn(3, 3), random.random(), np.random.rand(2)

    set_seed(123)
    first = draw()
    set_seed(123)
    second = draw()
    set_seed(124)
    other = draw()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert first[2] == second[2]
    assert np.array_equal(first[3], second[3])
    assert not torch.equal(first[0], other[0])
    assert first[2] != other[2]


def test_set_seed_returns_the_seed_and_rejects_non_integers():
    assert set_seed(5) == 5
    assert set_seed(5, device_specific=True) == 5  # rank 0
    with pytest.raises(TypeError, match="'5'"):
        set_seed("5")
    with pytest.raises(TypeError):
        set_seed(True)
