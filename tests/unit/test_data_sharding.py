"""Sharding of dataloaders (impel.runtime.loaders.data) without a process group: each rank is
built with an explicit rank/world."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from helpers import IndexDataset
from impel import Accelerator, ConfigError, DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from impel.runtime.loaders.data import DataLoaderShard, shard_dataloader
from impel.runtime.step.accumulation import GradientState

SEED = 1234


def shard(loader: DataLoader, world: int, rank: int, seed: int = SEED, **config) -> DataLoaderShard:
    """Rank ``rank``'s prepared loader, built after ``torch.manual_seed(seed)`` as each real rank would be."""
    torch.manual_seed(seed)
    return shard_dataloader(loader, world=world, rank=rank, device=None, config=DataLoaderConfiguration(**config),
                            gradient_state=GradientState(GradientAccumulationPlugin()))


def ranks(make_loader, world: int = 2, **config) -> list[DataLoaderShard]:
    """One prepared loader per rank, each over its own copy of the user's DataLoader (as on real ranks)."""
    return [shard(make_loader(), world, r, **config) for r in range(world)]


def batches(dl) -> list[list[int]]:
    return [b.flatten().tolist() for b in dl]


def index_loader(n: int, batch_size: int, shuffle: bool = False, drop_last: bool = False):
    """A loader factory; shuffled ones draw from their own generator, so one process and several ranks (each
    agreeing on it) draw the same permutation."""
    return lambda: DataLoader(IndexDataset(n), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                              generator=torch.Generator().manual_seed(SEED) if shuffle else None)



class RangeIterable(IterableDataset):
    """An iterable dataset yielding [0], [1], ...; sized only when asked."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([i])


class SizedRangeIterable(RangeIterable):
    def __len__(self) -> int:
        return self.n


def flat(per_rank: list[list[list[int]]]) -> list[int]:
    return [i for rank_batches in per_rank for b in rank_batches for i in b]


# --- disjoint shards that cover the dataset ---------------------------------------------------------------------

@pytest.mark.parametrize("n,batch_size", [(16, 4), (13, 3), (10, 4), (9, 4), (3, 4), (1, 2)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_are_disjoint_and_cover_the_dataset(n, batch_size, shuffle):
    per_rank = [batches(dl) for dl in ranks(index_loader(n, batch_size, shuffle), even_batches=False)]
    everything = flat(per_rank)
    assert sorted(everything) == list(range(n))  # disjoint (no repeats) and complete
    assert set(flat(per_rank[:1])).isdisjoint(flat(per_rank[1:]))


@pytest.mark.parametrize("n,batch_size", [(16, 4), (13, 3), (11, 4), (9, 4), (3, 4)])
def test_even_batches_cover_the_dataset_and_only_repeat_padding(n, batch_size):
    dls = ranks(index_loader(n, batch_size))
    per_rank = [batches(dl) for dl in dls]
    everything = flat(per_rank)
    assert set(everything) == set(range(n))
    global_batch = 2 * batch_size
    rest = n % global_batch
    padding = 0 if rest == 0 else global_batch - rest  # the last global batch is completed to full size
    assert len(everything) == n + padding


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("n,batch_size", [(16, 4), (13, 3), (10, 4), (9, 4)])
def test_rank_batches_concatenate_to_the_single_process_double_batch(n, batch_size, shuffle):
    r0, r1 = (batches(dl) for dl in ranks(index_loader(n, batch_size, shuffle), even_batches=False))
    single = batches(shard(index_loader(n, 2 * batch_size, shuffle)(), 1, 0))
    joined = [a + b for a, b in itertools.zip_longest(r0, r1, fillvalue=[])]
    assert joined == single
    if shuffle:
        assert sorted(i for b in single for i in b) == list(range(n))
        assert [i for b in single for i in b] != list(range(n))


@pytest.mark.parametrize("n,batch_size", [(16, 4), (13, 3), (11, 4)])
def test_even_batches_concatenation_truncated_to_remainder_is_the_single_process_batch(n, batch_size):
    dls = ranks(index_loader(n, batch_size, shuffle=True))
    r0, r1 = batches(dls[0]), batches(dls[1])
    single = batches(shard(index_loader(n, 2 * batch_size, True)(), 1, 0))
    assert len(r0) == len(r1) == len(single)
    for step, (a, b) in enumerate(zip(r0, r1)):
        joined = a + b
        if step < len(single) - 1:
            assert joined == single[step]
        else:
            assert dls[0].remainder == dls[1].remainder == len(single[-1])
            assert joined[:dls[0].remainder] == single[-1]


# --- even batches, remainder, drop_last ---------------------------------------------------------------------------

def test_even_batches_pads_last_batch_from_the_start():
    # 11 samples, 2 ranks x 4: [0..7], then 3 real samples [8, 9, 10] completed to 8 with samples 0..4
    r0, r1 = (batches(dl) for dl in ranks(index_loader(11, 4)))
    assert r0 == [[0, 1, 2, 3], [8, 9, 10, 0]]
    assert r1 == [[4, 5, 6, 7], [1, 2, 3, 4]]


def test_even_batches_pads_when_fewer_samples_than_ranks_remain():
    r0, r1 = (batches(dl) for dl in ranks(index_loader(9, 4)))
    assert r0 == [[0, 1, 2, 3], [8, 0, 1, 2]]
    assert r1 == [[4, 5, 6, 7], [3, 4, 5, 6]]


def test_even_batches_padding_comes_from_the_start_of_the_shuffled_epoch():
    dls = ranks(index_loader(11, 4, shuffle=True))
    r0, r1 = batches(dls[0]), batches(dls[1])
    order = [i for b in batches(shard(index_loader(11, 8, True)(), 1, 0)) for i in b]
    assert r0[0] + r1[0] + r0[1] + r1[1] == order + order[:5]


def test_even_batches_padding_wraps_around_a_dataset_smaller_than_the_global_batch():
    r0, r1 = (batches(dl) for dl in ranks(index_loader(3, 4)))
    assert r0 == [[0, 1, 2, 0]] and r1 == [[1, 2, 0, 1]]


@pytest.mark.parametrize("n,batch_size", [(11, 4), (9, 4), (13, 3), (16, 4), (3, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_even_batches_gives_every_rank_the_same_number_and_sizes_of_batches(n, batch_size, shuffle):
    r0, r1 = (batches(dl) for dl in ranks(index_loader(n, batch_size, shuffle)))
    assert [len(b) for b in r0] == [len(b) for b in r1]
    assert all(len(b) == batch_size for b in r0[:-1])


@pytest.mark.parametrize("n,batch_size,expected", [(11, 4, 3), (9, 4, 1), (16, 4, 8), (13, 3, 1), (3, 4, 3)])
@pytest.mark.parametrize("even", [True, False])
def test_remainder_is_the_number_of_real_samples_in_the_last_global_batch(n, batch_size, expected, even):
    for dl in ranks(index_loader(n, batch_size), even_batches=even):
        assert dl.remainder == expected
        list(dl)
        assert dl.remainder == expected


def test_remainder_with_drop_last_is_the_full_global_batch():
    for dl in ranks(index_loader(11, 4, drop_last=True)):
        assert dl.remainder == 8


def test_even_batches_false_gives_no_duplicates_and_uneven_counts():
    dls = ranks(index_loader(9, 4), even_batches=False)
    r0, r1 = batches(dls[0]), batches(dls[1])
    assert r0 == [[0, 1, 2, 3], [8]]
    assert r1 == [[4, 5, 6, 7]]
    assert (len(dls[0]), len(dls[1])) == (2, 1)
    everything = flat([r0, r1])
    assert len(everything) == len(set(everything)) == 9


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last_drops_the_short_global_batch(even, shuffle):
    dls = ranks(index_loader(11, 4, shuffle=shuffle, drop_last=True), even_batches=even)
    r0, r1 = batches(dls[0]), batches(dls[1])
    assert len(r0) == len(r1) == len(dls[0]) == len(dls[1]) == 1
    assert len(r0[0]) == len(r1[0]) == 4
    single = batches(shard(index_loader(11, 8, shuffle, drop_last=True)(), 1, 0))
    assert [r0[0] + r1[0]] == single
    if not shuffle:
        assert r0[0] + r1[0] == list(range(8))


# --- split_batches ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [False, True])
def test_split_batches_splits_the_global_batch(shuffle):
    split = [batches(dl) for dl in ranks(index_loader(13, 6, shuffle), split_batches=True, even_batches=False)]
    per_rank = [batches(dl) for dl in ranks(index_loader(13, 3, shuffle), even_batches=False)]
    assert split == per_rank
    assert all(len(b) == 3 for b in split[0][:-1])
    single = batches(shard(index_loader(13, 6, shuffle)(), 1, 0))
    assert [a + b for a, b in itertools.zip_longest(*split, fillvalue=[])] == single


def test_split_batches_reports_batch_size_and_total_batch_size():
    dl = shard(DataLoader(IndexDataset(16), batch_size=8), 2, 0, split_batches=True)
    assert dl.batch_size == 4
    assert dl.total_batch_size == 8
    dl = shard(DataLoader(IndexDataset(16), batch_size=8), 2, 0)
    assert dl.batch_size == 8
    assert dl.total_batch_size == 16


def test_split_batches_rejects_an_indivisible_batch_size():
    with pytest.raises(ConfigError) as err:
        shard(DataLoader(IndexDataset(16), batch_size=7), 2, 0, split_batches=True)
    assert "7" in str(err.value) and "2" in str(err.value)


def test_split_batches_rejects_a_custom_batch_sampler():
    sampler = BatchSampler(SequentialSampler(range(10)), 4, False)
    with pytest.raises(ConfigError, match="batch_sampler"):
        shard(DataLoader(IndexDataset(10), batch_sampler=sampler), 2, 0, split_batches=True)


# --- iterable datasets --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,batch_size", [(16, 4), (13, 3), (11, 4), (9, 4), (3, 4)])
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_shards_like_a_map_style_dataset(n, batch_size, even, drop_last):
    iterable = [batches(dl) for dl in ranks(
        lambda: DataLoader(RangeIterable(n), batch_size=batch_size, drop_last=drop_last), even_batches=even)]
    mapped = [batches(dl) for dl in ranks(index_loader(n, batch_size, drop_last=drop_last), even_batches=even)]
    assert iterable == mapped


@pytest.mark.parametrize("n,batch_size", [(16, 4), (13, 3), (11, 4), (9, 4), (3, 4)])
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sized_iterable_dataset_len_matches_batches_yielded(n, batch_size, even, drop_last):
    for dl in ranks(lambda: DataLoader(SizedRangeIterable(n), batch_size=batch_size, drop_last=drop_last),
                    even_batches=even):
        assert len(dl) == len(batches(dl))


def test_unsized_iterable_dataset_has_no_len():
    dl = shard(DataLoader(RangeIterable(8), batch_size=2), 2, 0)
    with pytest.raises(TypeError):
        len(dl)
    assert dl.remaining_batches() is None
    assert batches(dl) == [[0, 1], [4, 5]]


def test_iterable_dataset_remainder_is_known_at_the_last_batch():
    dl = shard(DataLoader(RangeIterable(11), batch_size=4), 2, 1)
    seen = []
    for batch in dl:
        if dl.end_of_dataloader:
            seen.append((batch.flatten().tolist(), dl.remainder))
    assert seen == [([1, 2, 3, 4], 3)]  # [8, 9, 10] completed with 0..4; rank 1 holds the padding


def test_iterable_dataset_with_workers_is_rejected():
    with pytest.raises(ConfigError, match="num_workers=2"):
        shard(DataLoader(RangeIterable(8), batch_size=2, num_workers=2), 2, 0)


# --- custom batch samplers ----------------------------------------------------------------------------------------

def custom_loader(n: int, batch_size: int):
    return lambda: DataLoader(IndexDataset(n), batch_sampler=BatchSampler(SequentialSampler(range(n)), batch_size,
                                                                           False))


def test_custom_batch_sampler_is_sharded_by_whole_batches():
    dls = ranks(custom_loader(10, 3))  # batches [0,1,2] [3,4,5] [6,7,8] [9]: the short one is completed
    assert batches(dls[0]) == [[0, 1, 2], [6, 7, 8]]
    assert batches(dls[1]) == [[3, 4, 5], [9, 0, 1]]
    assert dls[0].remainder == dls[1].remainder == 4


@pytest.mark.parametrize("even", [True, False])
def test_custom_batch_sampler_with_an_odd_number_of_batches(even):
    dls = ranks(custom_loader(13, 3), even_batches=even)  # batches [0..2] [3..5] [6..8] [9..11] [12]
    r0, r1 = batches(dls[0]), batches(dls[1])
    if even:
        assert r0 == [[0, 1, 2], [6, 7, 8], [12, 0, 1]]
        assert r1 == [[3, 4, 5], [9, 10, 11], [2, 3, 4]]
    else:
        assert r0 == [[0, 1, 2], [6, 7, 8], [12]]
        assert r1 == [[3, 4, 5], [9, 10, 11]]
    assert (len(dls[0]), len(dls[1])) == (len(r0), len(r1))
    assert dls[0].remainder == dls[1].remainder == 1


def test_distributed_sampler_is_rejected():
    ds = IndexDataset(10)
    loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    with pytest.raises(ConfigError, match="DistributedSampler"):
        shard(loader, 2, 0)


def test_loader_without_automatic_batching_is_sharded_sample_by_sample():
    # DataLoader(batch_size=None): each rank takes every world-th sample, padded from the start with even_batches
    loaders = [shard(DataLoader(IndexDataset(5), batch_size=None), 2, r) for r in (0, 1)]
    assert [[int(s) for s in loader] for loader in loaders] == [[0, 2, 4], [1, 3, 0]]
    assert loaders[0].batch_size is None and len(loaders[0]) == 3
    with pytest.raises(ConfigError, match="batch_size=None.*split_batches"):
        shard(DataLoader(IndexDataset(4), batch_size=None), 2, 0, split_batches=True)


# --- len ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make_loader", [index_loader(16, 4), index_loader(13, 3), index_loader(11, 4),
                                         index_loader(9, 4), index_loader(3, 4), index_loader(11, 4, True, True),
                                         custom_loader(10, 3), custom_loader(13, 3)])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("even", [True, False])
def test_len_matches_batches_yielded(make_loader, world, even):
    for dl in ranks(make_loader, world=world, even_batches=even):
        assert len(dl) == len(batches(dl))


# --- epochs -------------------------------------------------------------------------------------------------------

def union_per_step(dls: list[DataLoaderShard]) -> list[list[int]]:
    return [sum(step, []) for step in zip(*(batches(dl) for dl in dls))]


def test_set_epoch_changes_the_shuffle_and_ranks_agree():
    orders = {}
    for epoch in (0, 1, 2):
        dls = ranks(index_loader(20, 2, shuffle=True), even_batches=False, use_seedable_sampler=True)
        for dl in dls:
            dl.set_epoch(epoch)
        single = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
        single.set_epoch(epoch)
        union = union_per_step(dls)
        assert union == batches(single)  # both ranks drew the same permutation as one process
        order = sum(union, [])
        assert sorted(order) == list(range(20))
        orders[epoch] = order
    assert orders[0] != orders[1] != orders[2] != orders[0]


def test_same_epoch_gives_the_same_order_on_fresh_loaders():
    a = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    b = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    a.set_epoch(3)
    b.set_epoch(3)
    assert batches(a) == batches(b)


def test_a_different_seed_gives_a_different_shuffle():
    a = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, seed=1, use_seedable_sampler=True)
    b = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, seed=2, use_seedable_sampler=True)
    assert batches(a) != batches(b)


def test_a_complete_pass_advances_the_epoch():
    dl = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    assert dl.epoch == 0
    first = batches(dl)
    assert dl.epoch == 1
    second = batches(dl)
    assert dl.epoch == 2
    assert first != second
    ref = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    ref.set_epoch(1)
    assert batches(ref) == second


def test_an_interrupted_pass_does_not_advance_the_epoch():
    dl = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    full = batches(shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True))
    for i, _ in enumerate(dl):
        if i == 1:
            break
    assert dl.epoch == 0
    assert batches(dl) == full


def test_both_ranks_advance_epochs_in_step():
    dls = ranks(index_loader(20, 2, shuffle=True), even_batches=False, use_seedable_sampler=True)
    epoch0 = union_per_step(dls)
    epoch1 = union_per_step(dls)
    single = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    assert epoch0 == batches(single)
    assert epoch1 == batches(single)
    assert epoch0 != epoch1


# --- non-seedable sampler -----------------------------------------------------------------------------------------

def test_non_seedable_sampler_still_shuffles():
    dl = shard(DataLoader(IndexDataset(32), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=False)
    order = sum(batches(dl), [])
    assert sorted(order) == list(range(32))
    assert order != list(range(32))


def test_non_seedable_sampler_through_the_accelerator_shuffles_differently_each_epoch():
    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=False))
    dl = acc.prepare(DataLoader(IndexDataset(32), batch_size=4, shuffle=True))
    first, second = sum(batches(dl), []), sum(batches(dl), [])
    for order in (first, second):
        assert sorted(order) == list(range(32))
        assert order != list(range(32))
    assert first != second


def test_a_shuffled_loader_through_the_accelerator_follows_the_global_seed():
    orders = []
    for _ in range(2):
        set_seed(7)
        acc = Accelerator(cpu=True)
        dl = acc.prepare(DataLoader(IndexDataset(32), batch_size=4, shuffle=True))
        orders.append(sum(batches(dl), []))
    assert orders[0] == orders[1]
    assert sorted(orders[0]) == list(range(32)) and orders[0] != list(range(32))


def test_sequential_loader_is_not_shuffled():
    dl = shard(DataLoader(IndexDataset(10), batch_size=4), 1, 0)
    assert batches(dl) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches(dl) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_dataloader_look_alike_attributes():
    loader = DataLoader(IndexDataset(10), batch_size=4)
    dl = shard(loader, 2, 0)
    assert dl.dataset is loader.dataset
    assert dl.batch_size == 4
    assert dl.total_batch_size == 8


def test_batches_move_to_the_requested_device():
    dl = shard_dataloader(DataLoader(IndexDataset(4), batch_size=2), world=1, rank=0, device=torch.device("cpu"),
                          config=DataLoaderConfiguration(), gradient_state=GradientState(GradientAccumulationPlugin()))
    assert all(b.device.type == "cpu" for b in dl)


@pytest.mark.parametrize("samples, expected", [(1, "rank 0: 1, rank 1: 0"), (5, "rank 0: 2, rank 1: 1")])
def test_uneven_batches_per_rank_are_named_once_by_rank_0(samples, expected):
    """even_batches=False: a rank with fewer batches leaves the loop while the others all-reduce (a hang until the
    group timeout); rank 0 says so once, with every rank's count, and join_uneven_inputs silences it."""
    import warnings

    dl0, dl1 = (shard(DataLoader(IndexDataset(samples), batch_size=2), 2, r, even_batches=False) for r in (0, 1))
    with pytest.warns(UserWarning, match=rf"even_batches=False\) gives the ranks different numbers of batches per "
                                         rf"pass \({expected}\).*join_uneven_inputs"):
        list(dl0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(dl0)  # once per loader
        list(dl1)  # rank 0 says it for every rank
        joined = shard(DataLoader(IndexDataset(samples), batch_size=2), 2, 0, even_batches=False)
        joined.shard.joined = True  # what Accelerator.join_uneven_inputs sets
        list(joined)
        list(shard(DataLoader(IndexDataset(4), batch_size=2), 2, 0, even_batches=False))  # 1 batch each
