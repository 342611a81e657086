"""A prepared DataLoader is a torch DataLoader with the attributes Accelerate's prepared loaders expose, and it
iterates exactly as before (order compared with Accelerate 1.15 in test_data_order_matches_accelerate.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from helpers import IndexDataset
from impel import Accelerator


def _collate(batch):
    return torch.cat(batch)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(7).unsqueeze(1))


def test_prepared_loader_is_a_dataloader_with_its_attributes():
    acc = Accelerator(cpu=True)
    gen = torch.Generator().manual_seed(3)
    user = DataLoader(IndexDataset(10), batch_size=2, shuffle=True, generator=gen, drop_last=True,
                      collate_fn=_collate)
    dl = acc.prepare(user)
    assert isinstance(dl, DataLoader)
    assert (dl.dataset, dl.batch_size, dl.drop_last, dl.num_workers, dl.collate_fn, dl.generator) == (
        user.dataset, 2, True, 0, _collate, gen)
    assert (dl.pin_memory, dl.timeout, dl.worker_init_fn, dl.persistent_workers, dl.multiprocessing_context) == (
        False, 0, None, False, None)
    assert dl.sampler is dl.batch_sampler.sampler  # the sampler ordering the epoch, inside this rank's batches
    assert (dl.batch_sampler.batch_size, dl.batch_sampler.drop_last, dl.batch_sampler.even_batches) == (2, True, True)
    assert len(list(dl)) == len(dl) == 5


def test_attributes_of_a_custom_batch_sampler_and_an_iterable_dataset():
    acc = Accelerator(cpu=True)
    batches = torch.utils.data.BatchSampler(SequentialSampler(range(9)), batch_size=4, drop_last=False)
    dl = acc.prepare(DataLoader(IndexDataset(9), batch_sampler=batches))
    assert isinstance(dl, DataLoader) and dl.batch_sampler.batch_sampler is batches and dl.drop_last is False
    stream = acc.prepare(DataLoader(_Stream(), batch_size=3))
    assert isinstance(stream, DataLoader) and stream.batch_size == 3 and stream.sampler is None
    assert [b.flatten().tolist() for b in stream] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_order_and_the_resume_position_are_unchanged(shuffle):
    """The same batches as the user's loader on one process (torch's order); a skip and a saved position work."""
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    expected = [b.flatten().tolist() for b in DataLoader(IndexDataset(11), batch_size=3, shuffle=shuffle)]
    torch.manual_seed(0)
    dl = acc.prepare(DataLoader(IndexDataset(11), batch_size=3, shuffle=shuffle))
    assert [b.flatten().tolist() for b in dl] == expected
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    assert state["position"] == 1
    clone = copy.deepcopy(dl)
    assert isinstance(clone, DataLoader) and clone.batch_size == 3
