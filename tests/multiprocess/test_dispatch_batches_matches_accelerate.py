"""DataLoaderConfiguration(dispatch_batches=True): rank 0 reads, every rank receives its slice, with Accelerate
1.15's batches, remainders and global RNG draws (compared with Accelerate itself on 2 CPU ranks)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from helpers import IndexDataset
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess
pytest.importorskip("accelerate")
ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}  # else Accelerate on a CPU box under torchrun trains unsynchronised


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter({"x": torch.tensor([i]), "y": torch.tensor(float(i))} for i in range(self.n))


def _passes(framework: str, case: str) -> dict:
    if framework == "accelerate":
        from accelerate import Accelerator, DataLoaderConfiguration
    else:
        from impel import Accelerator, DataLoaderConfiguration
    split = case.startswith("split")
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True, split_batches=split))
    torch.manual_seed(11)
    if case == "stream":
        loader = DataLoader(Stream(11), batch_size=3)
    else:
        loader = DataLoader(IndexDataset(23), batch_size=4 if split else 3, shuffle=True,
                            drop_last=case == "drop_last")
    loader = acc.prepare(loader)
    out: dict = {"len": len(loader) if case != "stream" else None, "epochs": []}
    for _ in range(2):
        seen, remainders = [], []
        for batch in loader:
            seen.append(batch["x"].flatten().tolist() if case == "stream" else batch.flatten().tolist())
            remainders.append(acc.gradient_state.remainder if acc.gradient_state.end_of_dataloader else None)
        gathered = acc.gather_for_metrics(torch.tensor(seen[-1])).tolist()
        out["epochs"].append({"batches": seen, "remainder": remainders[-1], "gathered": gathered,
                              "rng": torch.rand(1).item()})
    return out


@pytest.mark.parametrize("case", ["shuffled", "drop_last", "split", "stream"])
def test_dispatched_batches_match_accelerate(case):
    theirs = run_on_ranks(_passes, 2, args=("accelerate", case), env=ACCELERATE_ENV, timeout=240)
    ours = run_on_ranks(_passes, 2, args=("impel", case), timeout=240)
    assert ours == theirs
    assert theirs[0]["epochs"][0]["batches"] != theirs[1]["epochs"][0]["batches"]  # each rank its own slice


def _direct_dispatchers(framework: str) -> list:
    """Accelerate's DataLoaderDispatcher built directly (not by prepare), with and without its _drop_last."""
    if framework == "accelerate":
        from accelerate import PartialState
        from accelerate.data_loader import DataLoaderDispatcher
    else:
        from impel import PartialState
        from impel.data_loader import DataLoaderDispatcher
    PartialState(cpu=True)
    out = []
    for drop_last in (False, True):
        for private in (False, True):
            loader = DataLoaderDispatcher(list(range(10)), batch_size=3, drop_last=drop_last, _drop_last=private)
            out.append((len(loader), [b.tolist() for b in loader]))
    cut = DataLoaderDispatcher(list(range(8)), batch_size=2,
                               slice_fn=lambda b, part, process_index, num_processes: b[part].flip(0))
    return out + [[b.tolist() for b in cut]]


def test_data_loader_dispatcher_built_directly_matches_accelerate():
    theirs = run_on_ranks(_direct_dispatchers, 2, args=("accelerate",), env=ACCELERATE_ENV, timeout=240)
    assert run_on_ranks(_direct_dispatchers, 2, args=("impel",), timeout=240) == theirs


class RankStream(IterableDataset):
    """A stream of 10 samples on rank 0 and 6 on rank 1: a dataset sharded by hand, unevenly."""

    def __iter__(self):
        import torch.distributed as dist

        return iter(torch.tensor([float(i)]) for i in range(10 if dist.get_rank() == 0 else 6))


def _uneven_stream(framework: str) -> dict:
    if framework == "accelerate":
        from accelerate import Accelerator
    else:
        from impel import Accelerator
    acc = Accelerator(cpu=True)  # dispatch_batches=None: Accelerate's default dispatches an iterable dataset
    torch.manual_seed(3)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(RankStream(), batch_size=2))
    seen, gathered = [], []
    for batch in loader:
        acc.backward(model(batch).sum())
        opt.step()
        opt.zero_grad()
        seen.append(batch.flatten().tolist())
        gathered.append(acc.gather_for_metrics(batch).flatten().tolist())
    return {"seen": seen, "gathered": gathered, "weight": [p.detach().flatten().tolist() for p in model.parameters()]}


def test_an_iterable_dataset_of_unequal_lengths_per_rank_is_dispatched_by_default_as_accelerate():
    """Read per rank, rank 1 would stop after 2 batches while rank 0 waits in its 3rd step's all-reduce until the
    group timeout; dispatched (Accelerate's default), rank 0's stream feeds both and every rank stops together."""
    theirs = run_on_ranks(_uneven_stream, 2, args=("accelerate",), env=ACCELERATE_ENV, timeout=240)
    ours = run_on_ranks(_uneven_stream, 2, args=("impel",), timeout=120)
    assert ours == theirs
    assert len(ours[0]["seen"]) == len(ours[1]["seen"]) == 3
    assert ours[0]["gathered"][-1] == [8.0, 9.0]  # the completed last batch's duplicates dropped
