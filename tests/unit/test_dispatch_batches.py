"""dispatch_batches=True on one process: the user's batches, impel's position and resume, and the settings it
cannot honour raising (2 ranks against Accelerate: tests/multiprocess/test_dispatch_batches_matches_accelerate.py)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import IndexDataset
from impel import Accelerator, ConfigError, DataLoaderConfiguration


def _accelerator(**config):
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True, **config))


def test_one_process_gets_the_users_batches_and_resumes_mid_epoch():
    acc = _accelerator()
    torch.manual_seed(0)
    expected = [b.flatten().tolist() for b in DataLoader(IndexDataset(10), batch_size=3, shuffle=True)]
    torch.manual_seed(0)
    dl = acc.prepare(DataLoader(IndexDataset(10), batch_size=3, shuffle=True))
    assert isinstance(dl, DataLoader) and (len(dl), dl.batch_size, dl.drop_last) == (4, 3, False)
    assert [b.flatten().tolist() for b in dl] == expected
    torch.manual_seed(1)
    it = iter(dl)
    first = [next(it).flatten().tolist() for _ in range(2)]
    state = dl.state_dict()
    rest = [b.flatten().tolist() for b in it]
    dl.load_state_dict(state)
    assert [b.flatten().tolist() for b in dl] == rest and len(first + rest) == 4
    import copy
    import pickle

    for clone in (pickle.loads(pickle.dumps(dl)), copy.deepcopy(dl)):
        assert len(clone) == 4 and clone.batch_size == 3


def test_settings_dispatch_cannot_honour_raise():
    loader = DataLoader(IndexDataset(10), batch_size=2, shuffle=True)
    with pytest.raises(ConfigError, match="needs device placement"):
        _accelerator().prepare_data_loader(loader, device_placement=False)
    with pytest.raises(ConfigError, match="use_seedable_sampler=True has nothing to agree on"):
        _accelerator(use_seedable_sampler=True).prepare(loader)


def test_batches_of_different_shapes_name_the_fix():
    from impel.runtime.loaders.dispatch import _concatenate

    with pytest.raises(ConfigError, match="pass split_batches=True"):
        _concatenate([torch.zeros(2, 3), torch.zeros(2, 4)])
    joined = _concatenate([{"a": torch.ones(1, 2), "b": [torch.zeros(1)]},
                           {"a": torch.ones(2, 2), "b": [torch.ones(2)]}])
    assert joined["a"].shape == (3, 2) and joined["b"][0].tolist() == [0.0, 1.0, 1.0]
