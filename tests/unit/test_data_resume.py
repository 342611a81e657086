"""Skipping and resuming prepared dataloaders (impel.runtime.loaders.data): skip_batches, skip_first_batches,
state_dict round
trips
that replay the interrupted pass without consuming the live global RNG. Ranks are built as in test_data_sharding."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import IndexDataset
from impel import ConfigError
from impel.runtime.loaders.data import skip_first_batches
from test_data_sharding import RangeIterable, batches, custom_loader, shard

# --- skipping and resuming ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("skip", [0, 1, 3, 5, 6])
def test_skip_batches_continues_with_exactly_the_next_batch(rank, skip):
    # 6 batches
    full = batches(shard(DataLoader(IndexDataset(23), batch_size=2, shuffle=True), 2, rank, use_seedable_sampler=True))
    dl = shard(DataLoader(IndexDataset(23), batch_size=2, shuffle=True), 2, rank, use_seedable_sampler=True)
    dl.skip_batches(skip)
    assert batches(dl) == full[skip:]
    assert len(dl) == len(full)
    assert dl.epoch == 1
    # the skip applies to one pass only
    again = shard(DataLoader(IndexDataset(23), batch_size=2, shuffle=True), 2, rank, use_seedable_sampler=True)
    again.set_epoch(1)
    assert batches(dl) == batches(again)


def test_skip_batches_rejects_negative_counts():
    dl = shard(DataLoader(IndexDataset(8), batch_size=2), 1, 0)
    with pytest.raises(ValueError, match="-1"):
        dl.skip_batches(-1)


@pytest.mark.parametrize("skip", [0, 2, 4])
def test_skip_first_batches_of_a_prepared_loader(skip):
    dl = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    ref = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    epoch0, epoch1 = batches(ref), batches(ref)
    skipped = skip_first_batches(dl, skip)
    assert skipped is not dl
    assert batches(skipped) == epoch0[skip:]
    # the view shares the original's progress: finishing it ends epoch 0, so the original goes on with epoch 1
    assert dl.epoch == 1
    assert batches(dl) == epoch1


def test_skip_first_batches_keeps_the_epoch_of_the_original():
    dl = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    dl.set_epoch(4)
    ref = shard(DataLoader(IndexDataset(20), batch_size=4, shuffle=True), 1, 0, use_seedable_sampler=True)
    ref.set_epoch(4)
    assert batches(skip_first_batches(dl, 2)) == batches(ref)[2:]


def test_skip_first_batches_of_a_plain_dataloader():
    loader = DataLoader(IndexDataset(10), batch_size=3)
    skipped = skip_first_batches(loader, 2)
    assert batches(skipped) == [[6, 7, 8], [9]]
    assert len(skipped) == 2


def test_skip_first_batches_rejects_an_unprepared_iterable():
    with pytest.raises(ConfigError, match="DataLoader"):
        skip_first_batches(DataLoader(RangeIterable(4), batch_size=2), 1)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("seedable", [False, True])
@pytest.mark.parametrize("stop_after", [1, 2, 6])
def test_state_dict_resumes_with_exactly_the_next_batch(world, seedable, stop_after):
    """A resumed pass replays the interrupted one's order and leaves torch's global RNG where the
    uninterrupted run has it (load_state restores the process RNG first, as simulated here)."""
    def make():
        return shard(DataLoader(IndexDataset(23), batch_size=2, shuffle=True), world, world - 1,
                     use_seedable_sampler=seedable)

    dl = make()
    list(dl)  # epoch 0
    full, after_full = batches(dl), torch.get_rng_state()
    epoch2 = batches(dl)
    dl = make()
    list(dl)
    seen = []
    for batch in dl:
        seen.append(batch.flatten().tolist())
        if len(seen) == stop_after:
            break
    state, rng = dl.state_dict(), torch.get_rng_state()
    assert (state["epoch"], state["position"]) == (1, stop_after)
    resumed = make()  # a new process, seeded as the first one was
    torch.set_rng_state(rng)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["rng"].keys() == state["rng"].keys()  # saved again before the pass: unchanged
    assert seen + batches(resumed) == full
    assert torch.equal(torch.get_rng_state(), after_full)
    assert batches(resumed) == epoch2


@pytest.mark.parametrize("seedable", [False, True])
def test_a_resume_through_skip_first_batches_is_not_replayed_next_epoch(seedable):
    """The transformers no-trainer resume: ``load_state`` then ``skip_first_batches(loader, n)`` for the rest of
    the epoch, then the loader itself. The view runs the resumed pass; the next epoch is the uninterrupted one's
    (it used to replay the resumed pass and skip its first batches again)."""
    def make():
        return shard(DataLoader(IndexDataset(12), batch_size=3, shuffle=True), 2, 1, use_seedable_sampler=seedable)

    dl = make()
    full = [batches(dl) for _ in range(3)]
    dl = make()
    list(dl)
    next(iter(dl))  # one batch of epoch 1, then the save
    state, rng = dl.state_dict(), torch.get_rng_state()
    resumed = make()
    torch.set_rng_state(rng)
    resumed.load_state_dict(state)
    view = skip_first_batches(resumed, state["position"])
    rest = iter(view)
    assert next(rest).flatten().tolist() == full[1][1]
    again, again_rng = resumed.state_dict(), torch.get_rng_state()  # save_state saves the prepared loader
    assert [b.flatten().tolist() for b in rest] == full[1][2:]
    assert (resumed.epoch, batches(resumed)) == (2, full[2])
    third = make()  # a second resume, from the save made during the view's pass
    torch.set_rng_state(again_rng)
    third.load_state_dict(again)
    assert batches(skip_first_batches(third, again["position"])) == full[1][2:]
    assert batches(third) == full[2]


def make_at_epoch(make, epoch):
    dl = make()
    dl.set_epoch(epoch)
    return dl


def test_skip_batches_on_an_iterable_dataset():
    full = batches(shard(DataLoader(RangeIterable(11), batch_size=2), 2, 1))
    dl = shard(DataLoader(RangeIterable(11), batch_size=2), 2, 1)
    dl.skip_batches(1)
    assert batches(dl) == full[1:]


def test_skip_batches_on_a_custom_batch_sampler():
    full = batches(shard(custom_loader(13, 3)(), 2, 0))
    dl = shard(custom_loader(13, 3)(), 2, 0)
    dl.skip_batches(2)
    assert batches(dl) == full[2:]
