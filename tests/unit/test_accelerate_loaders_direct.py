"""Accelerate's prepared-loader classes under impel's names: ``DataLoaderShard`` / ``DataLoaderDispatcher`` built
directly with Accelerate 1.15's constructors, what ``prepare`` returns (``isinstance`` as under Accelerate), and
loaders without automatic batching (``batch_size=None``). Accelerate, installed in the dev venv, is the reference:
same batches, lengths, ``end_of_dataloader`` and epoch counters, one process."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

acc_dl = pytest.importorskip("accelerate.data_loader")
import accelerate  # noqa: E402

import impel  # noqa: E402
import impel.data_loader as dl  # noqa: E402
from impel.config.plugins import DataLoaderConfiguration  # noqa: E402
from impel.runtime.loaders.data import shard_dataloader  # noqa: E402
from impel.runtime.step.accumulation import GradientState  # noqa: E402


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32).view(-1, 1))


def _pass(loader) -> tuple[list, list[bool]]:
    """The batches of one pass (as lists) and ``end_of_dataloader`` seen at each."""
    seen, ends = [], []
    for batch in loader:
        seen.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
        ends.append(loader.end_of_dataloader)
    return seen, ends


KWARGS = [
    {"batch_size": 4},
    {"batch_size": 4, "drop_last": True},
    {"batch_size": 3, "device": torch.device("cpu")},
    {"batch_sampler": BatchSampler(SequentialSampler(range(10)), 4, False)},
    {"sampler": BatchSampler(SequentialSampler(range(10)), 3, False), "batch_size": None},
    {"batch_size": None},
    {"batch_size": 4, "skip_batches": 1},
    {"batch_size": 2, "iteration": 3},
]


@pytest.mark.parametrize("kwargs", KWARGS, ids=lambda k: ",".join(sorted(k)))
def test_data_loader_shard_built_directly_equals_accelerates(kwargs):
    data = torch.arange(10)  # indexable by a list of indices too (sampler=BatchSampler(...), batch_size=None)
    mine, theirs = dl.DataLoaderShard(data, **kwargs), acc_dl.DataLoaderShard(data, **kwargs)
    assert isinstance(mine, DataLoader) and isinstance(mine, dl.DataLoaderShard)
    assert len(mine) == len(theirs) and mine.batch_size == theirs.batch_size
    assert mine.total_dataset_length == theirs.total_dataset_length == 10
    if kwargs.get("batch_size", 1) is not None:  # Accelerate's raises without a batch size
        assert mine.total_batch_size == theirs.total_batch_size
    for _ in range(2):  # a second pass: the epoch counter moves on, skip_batches skips again
        assert _pass(mine) == _pass(theirs), kwargs
        assert mine.iteration == theirs.iteration


def test_data_loader_shard_built_directly_shuffles_as_accelerates():
    def build(module):
        gen = torch.Generator().manual_seed(7)
        return module.DataLoaderShard(list(range(12)), batch_size=5, shuffle=True, generator=gen)

    mine, theirs = build(dl), build(acc_dl)
    for _ in range(2):
        assert _pass(mine) == _pass(theirs)
    mine.set_epoch(5)
    theirs.set_epoch(5)
    assert mine.iteration == theirs.iteration == 5


def test_data_loader_shard_built_directly_over_an_iterable_dataset_and_a_shard_batch_sampler():
    assert _pass(dl.DataLoaderShard(Stream(7), batch_size=3)) == _pass(acc_dl.DataLoaderShard(Stream(7), batch_size=3))
    # sharded by the batch sampler it is given, as under Accelerate (the class itself does not shard)
    for rank in (0, 1):
        mine = dl.DataLoaderShard(list(range(10)), batch_sampler=dl.BatchSamplerShard(
            BatchSampler(SequentialSampler(range(10)), 2, False), 2, rank))
        theirs = acc_dl.DataLoaderShard(list(range(10)), batch_sampler=acc_dl.BatchSamplerShard(
            BatchSampler(SequentialSampler(range(10)), 2, False), 2, rank))
        assert _pass(mine) == _pass(theirs) and mine.total_batch_size == theirs.total_batch_size == 4


def test_skip_first_batches_of_a_directly_built_loader_keeps_its_epoch_as_accelerates():
    for module in (dl, acc_dl):
        for cls in (module.DataLoaderShard, module.DataLoaderDispatcher):
            sampler = module.SeedableRandomSampler(list(range(16)), data_seed=3)
            loader = cls(list(range(16)), batch_sampler=BatchSampler(sampler, 4, False))
            loader.set_epoch(1)
            skipped = module.skip_first_batches(loader, num_batches=2)
            assert skipped.iteration == 1
            next(iter(skipped))
            assert sampler.epoch == 1, (module.__name__, cls.__name__)


def test_data_loader_shard_refuses_what_it_cannot_honour():
    with pytest.raises(Exception, match="torch_device_mesh"):
        dl.DataLoaderShard(list(range(4)), batch_size=2, torch_device_mesh=object())


@pytest.mark.parametrize("dispatch", [False, True])
def test_prepared_loader_class_is_accelerates(dispatch):
    classes = {}
    for module, acc_module in ((impel, dl), (accelerate, acc_dl)):
        config = module.DataLoaderConfiguration(dispatch_batches=dispatch)
        prepared = module.Accelerator(cpu=True, dataloader_config=config).prepare(DataLoader(list(range(8)),
                                                                                            batch_size=2))
        classes[module.__name__] = (isinstance(prepared, acc_module.DataLoaderShard),
                                    isinstance(prepared, acc_module.DataLoaderDispatcher),
                                    isinstance(prepared, DataLoader),
                                    isinstance(prepared, acc_module.DataLoaderStateMixin))
        accelerate.state.AcceleratorState._reset_state(True)
    assert classes["impel"] == classes["accelerate"] == (not dispatch, dispatch, True, True)


def _prepared_by_accelerate(make) -> tuple[list, list[bool]]:
    state = accelerate.state.PartialState(cpu=True)
    try:
        return _pass(acc_dl.prepare_data_loader(make(), num_processes=1, process_index=0, put_on_device=True,
                                                device=state.device))
    finally:
        accelerate.state.AcceleratorState._reset_state(True)


@pytest.mark.parametrize("make", [lambda: DataLoader(Stream(5), batch_size=None),
                                  lambda: DataLoader(list(range(5)), batch_size=None)], ids=["iterable", "map-style"])
def test_prepare_of_a_loader_without_batching_equals_accelerates(make):
    mine = impel.Accelerator(cpu=True).prepare(make())
    assert _pass(mine) == _prepared_by_accelerate(make) and mine.batch_size is None


def test_prepare_of_a_shuffled_loader_without_batching_keeps_its_order():
    def make():
        return DataLoader(list(range(6)), batch_size=None,
                          sampler=RandomSampler(range(6), generator=torch.Generator().manual_seed(2)))

    # Accelerate 1.15 rebuilds it without its sampler (in order: a deliberate difference); impel keeps the shuffle
    assert _prepared_by_accelerate(make)[0] == list(range(6))
    assert _pass(impel.Accelerator(cpu=True).prepare(make()))[0] == list(make()) != list(range(6))


@pytest.mark.parametrize("even", [True, False])
def test_a_loader_without_batching_is_dealt_sample_by_sample_on_several_ranks(even):
    # Accelerate 1.15 fails there (IterableDatasetShard multiplies batch_size=None); impel deals the samples as
    # batch_size=1 would, without collation: rank r takes samples r, r + W, ..., even_batches pads from the start
    config = DataLoaderConfiguration(even_batches=even)
    got = {kind: [[float(x) for x in shard_dataloader(make(), world=2, rank=r, device=None, config=config,
                                                      gradient_state=GradientState())] for r in (0, 1)]
           for kind, make in (("iterable", lambda: DataLoader(Stream(5), batch_size=None)),
                              ("map", lambda: DataLoader([float(i) for i in range(5)], batch_size=None)))}
    assert got["iterable"] == got["map"] == [[0, 2, 4], [1, 3, 0] if even else [1, 3]]
