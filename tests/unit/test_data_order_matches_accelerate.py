"""A prepared loader gives each rank the same batches as Accelerate 1.15's, epoch after epoch, and draws the same
numbers from torch's global RNG (so dropout after ``prepare`` matches too).

Ranks are built in one process with an explicit rank and world, each after ``torch.manual_seed`` (as every real
rank does after ``set_seed``); Accelerate's own ``prepare_data_loader`` is the reference, called the same way.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, WeightedRandomSampler

from helpers import IndexDataset
from impel import DataLoaderConfiguration, GradientAccumulationPlugin
from impel.runtime.loaders.data import shard_dataloader
from impel.runtime.step.accumulation import GradientState

accelerate_data_loader = pytest.importorskip("accelerate.data_loader")

SEED = 5
EPOCHS = 3


def _passes(dl) -> list[list[list[int]]]:
    return [[b.flatten().tolist() for b in dl] for _ in range(EPOCHS)]


def impel_run(make_loader, world: int, rank: int, **config):
    torch.manual_seed(SEED)
    dl = shard_dataloader(make_loader(), world=world, rank=rank, device=None,
                          config=DataLoaderConfiguration(**config), gradient_state=GradientState(
                              GradientAccumulationPlugin()))
    return _passes(dl), torch.get_rng_state()


def accelerate_run(make_loader, world: int, rank: int, **config):
    torch.manual_seed(SEED)
    dl = accelerate_data_loader.prepare_data_loader(make_loader(), device=None, num_processes=world,
                                                    process_index=rank, put_on_device=False, rng_types=None,
                                                    **config)
    return _passes(dl), torch.get_rng_state()


def assert_same_as_accelerate(make_loader, world: int, **config) -> None:
    for rank in range(world):
        ours, our_rng = impel_run(make_loader, world, rank, **config)
        theirs, their_rng = accelerate_run(make_loader, world, rank, **config)
        assert ours == theirs, f"rank {rank} of {world}: impel {ours} != Accelerate {theirs}"
        assert torch.equal(our_rng, their_rng), f"rank {rank}: the global RNG was consumed differently"


MAP_CASES = [case for case in itertools.product(
    (13, 10, 8, 3),  # dataset length
    (1, 2, 3),  # world
    (False, True),  # shuffle
    (False, True),  # drop_last
    (True, False),  # even_batches
    (False, True),  # split_batches
) if not (case[5] and 4 % case[1])]


@pytest.mark.parametrize("n,world,shuffle,drop_last,even,split", MAP_CASES)
def test_map_style_batches_match_accelerate(n, world, shuffle, drop_last, even, split):
    def make():
        return DataLoader(IndexDataset(n), batch_size=4, shuffle=shuffle, drop_last=drop_last)

    assert_same_as_accelerate(make, world, even_batches=even, split_batches=split)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("data_seed", [None, 11])
def test_seedable_sampler_matches_accelerate(world, data_seed):
    def make():
        return DataLoader(IndexDataset(11), batch_size=2, shuffle=True)

    assert_same_as_accelerate(make, world, use_seedable_sampler=True, data_seed=data_seed)


@pytest.mark.parametrize("world", [1, 2])
def test_data_seed_without_the_seedable_sampler_is_accepted_and_ignored_as_by_accelerate(world):
    def make():
        return DataLoader(IndexDataset(11), batch_size=2, shuffle=True)

    # Accelerate passes data_seed to the seedable sampler only: without it the order is the generator's
    with pytest.warns(UserWarning, match="data_seed=5.*changes nothing.*use_seedable_sampler=True"):
        assert_same_as_accelerate(make, world, data_seed=5)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("seedable", [False, True])
def test_a_user_generator_is_used_as_accelerate_uses_it(world, seedable):
    def make():
        return DataLoader(IndexDataset(10), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))

    assert_same_as_accelerate(make, world, use_seedable_sampler=seedable)


@pytest.mark.parametrize("world", [1, 2])
def test_sampling_with_replacement_matches_accelerate(world):
    def make():
        ds = IndexDataset(9)
        return DataLoader(ds, batch_size=3, sampler=RandomSampler(ds, replacement=True, num_samples=40))

    assert_same_as_accelerate(make, world)


@pytest.mark.parametrize("world", [2, 3])
def test_a_weighted_sampler_gets_a_shared_generator_as_in_accelerate(world):
    def make():
        return DataLoader(IndexDataset(12), batch_size=2,
                          sampler=WeightedRandomSampler(torch.linspace(0.1, 1.0, 12), num_samples=12))

    assert_same_as_accelerate(make, world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("inner", ["random", "sequential"])
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("n", [10, 3])
def test_a_custom_batch_sampler_is_sharded_as_in_accelerate(world, inner, even, n):
    def make():
        ds = IndexDataset(n)
        sampler = RandomSampler(ds) if inner == "random" else SequentialSampler(ds)
        return DataLoader(ds, batch_sampler=BatchSampler(sampler, 3, drop_last=False))

    assert_same_as_accelerate(make, world, even_batches=even)


class RangeIterable(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([i])

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("n,world,drop_last,split", [
    case for case in itertools.product((13, 12, 2), (1, 2, 3), (False, True), (False, True))
    if not (case[3] and 6 % case[1])])  # split_batches needs the batch size (6) divisible by the world
def test_iterable_datasets_are_sharded_as_in_accelerate(n, world, drop_last, split):
    def make():
        return DataLoader(RangeIterable(n), batch_size=6 if split else 2, drop_last=drop_last)

    # Accelerate shards iterables in place with dispatch_batches=False (its default for them is to dispatch from
    # rank 0, which gives the same batches for a dataset every rank can read)
    assert_same_as_accelerate(make, world, split_batches=split, dispatch_batches=False)


class UnevenBatches:
    """A batch sampler without a batch_size attribute: batches of 1, 2, 3, 1, 2, 3, ... indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(start + size, self.n)))
            start, size = start + size, size % 3 + 1

    def __len__(self) -> int:
        return len(list(iter(self)))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("n", [13, 2])
def test_a_batch_sampler_without_batch_size_deals_whole_batches_as_in_accelerate(world, even, n):
    assert_same_as_accelerate(lambda: DataLoader(IndexDataset(n), batch_sampler=UnevenBatches(n)), world,
                              even_batches=even)
