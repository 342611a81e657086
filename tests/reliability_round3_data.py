"""Rows of docs/reliability.md for issue 36's data cases (round 3): loaders whose ranks would run different numbers
of batches. The 2-rank run of the iterable case is ``tests/multiprocess/test_dispatch_batches_matches_accelerate.py``
(compared with Accelerate); the uneven-batches warning is taken here from rank 0's loader built in this process."""
from __future__ import annotations

import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from impel import DataLoaderConfiguration, GradientAccumulationPlugin
from impel.runtime.loaders.data import shard_dataloader
from impel.runtime.step.accumulation import GradientState

Row = tuple[str, str, str]


def round3_data_rows() -> list[Row]:
    loader = shard_dataloader(DataLoader(TensorDataset(torch.ones(1, 1)), batch_size=2), world=2, rank=0, device=None,
                              config=DataLoaderConfiguration(even_batches=False),
                              gradient_state=GradientState(GradientAccumulationPlugin()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(loader)
    (said,) = [str(w.message) for w in caught if "even_batches" in str(w.message)]
    return [
        ("ranks (`tests/multiprocess/test_dispatch_batches_matches_accelerate.py`, compared with Accelerate)",
         "an `IterableDataset` yielding 10 samples on rank 0 and 6 on rank 1, batch 2, default "
         "`DataLoaderConfiguration`, training and `gather_for_metrics`",
         "no error: dispatched from rank 0 as Accelerate's default (`dispatch_batches=None` on an iterable "
         "dataset): 3 batches on every rank, the same batches, gathers and weights as Accelerate"),
        ("data", "2 ranks, `DataLoaderConfiguration(even_batches=False)`, a 1-sample dataset, batch 2",
         f"UserWarning (rank 0, at the pass's start): {said}"),
    ]
