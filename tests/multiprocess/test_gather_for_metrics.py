"""gather_for_metrics returns exactly the single-process predictions: the even-batches padding is dropped."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from helpers import IndexDataset
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess


class _Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([i])


def _predict(n: int, batch: int, iterable: bool, split: bool):
    from impel import Accelerator, DataLoaderConfiguration

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=split))
    dataset = _Stream(n) if iterable else IndexDataset(n)
    loader = acc.prepare(DataLoader(dataset, batch_size=batch))
    model = acc.prepare(torch.nn.Linear(1, 1))
    preds, ids, objects, nested = [], [], [], []
    with torch.no_grad():
        for x in loader:
            out = model(x.float())
            preds.append(acc.gather_for_metrics(out))
            ids.append(acc.gather_for_metrics(x))
            objects.extend(acc.gather_for_metrics([f"s{int(i)}" for i in x], use_gather_object=True))
            nested.append(acc.gather_for_metrics({"ids": x, "pair": (x, x * 2)}))
    reference = model(torch.arange(n, dtype=torch.float32)[:, None]).detach()
    return {"preds": torch.cat(preds), "ids": torch.cat(ids).flatten().tolist(), "objects": objects,
            "nested": torch.cat([d["pair"][1] for d in nested]).flatten().tolist(), "reference": reference}


@pytest.mark.parametrize("iterable,split", [(False, False), (True, False), (False, True)])
def test_gather_for_metrics_101_samples(iterable, split):
    results = run_on_ranks(_predict, 2, args=(101, 8, iterable, split))
    for r in results:
        assert r["ids"] == list(range(101))
        assert r["objects"] == [f"s{i}" for i in range(101)]
        assert r["nested"] == [2 * i for i in range(101)]
        assert r["preds"].shape == (101, 1)
        torch.testing.assert_close(r["preds"], r["reference"], rtol=0, atol=1e-6)
