"""Accelerate's ``examples/by_feature/multi_process_metrics.py`` territory: data that does not divide evenly.

Written as an Accelerate user writes it (``tests/multiprocess/test_compat_scripts.py`` runs it as is under torchrun,
and renamed to impel under ``impel launch``): ``split_batches=True`` (the loader's batch size is the global one, cut
across the ranks; the scheduler then steps once per optimizer step, here a ``OneCycleLR`` that raises when stepped
past its end), 45 samples in batches of 8 so the last global batch is completed from the start of the epoch,
accumulation through a ``GradientAccumulationPlugin``, an evaluation whose duplicates ``gather_for_metrics`` drops
(tensors in a dict, and Python objects), and a second evaluation prepared after ``accelerator.even_batches = False``:
the last batch is cut unevenly across the ranks, gathered with ``pad_across_processes`` and with
``use_gather_object``.

Prints one line ``COMPAT {json}`` on the main process: the learning rate after every optimizer step, the final
parameters and the metrics of every epoch.
"""
import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

FEATURES, CLASSES = 6, 3


class Points(Dataset):
    """Points labelled by the arg-max of a fixed linear map, each with a string id."""

    def __init__(self, num_samples, seed):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, FEATURES, generator=generator)
        teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
        self.y = (self.x @ teacher).argmax(dim=-1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


def evaluate(accelerator, model, loader):
    """Accuracy and loss over every sample once: gather_for_metrics drops what even_batches duplicated."""
    model.eval()
    correct, losses, ids = 0, [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(batch["x"])
        per_sample = nn.functional.cross_entropy(logits, batch["y"], reduction="none")
        gathered = accelerator.gather_for_metrics({"pred": logits.argmax(-1), "y": batch["y"], "loss": per_sample})
        correct += (gathered["pred"] == gathered["y"]).sum().item()
        losses.append(gathered["loss"])
        ids += accelerator.gather_for_metrics([f"sample-{i}" for i in batch["index"].tolist()])
    return {"accuracy": correct / len(ids), "loss": torch.cat(losses).mean().item(), "samples": len(ids),
            "distinct": len(set(ids))}


def evaluate_uneven(accelerator, model, loader):
    """even_batches=False: ranks may hold different counts, so pad before gathering tensors."""
    model.eval()
    preds, records = [], []
    for batch in loader:
        with torch.no_grad():
            pred = model(batch["x"]).argmax(-1)
        padded = accelerator.pad_across_processes(torch.stack([batch["index"], pred], dim=1), dim=0, pad_index=-1)
        gathered = accelerator.gather(padded)
        preds.append(gathered[gathered[:, 0] >= 0])
        records += accelerator.gather_for_metrics(list(zip(batch["index"].tolist(), pred.tolist())),
                                                  use_gather_object=True)
    preds = torch.cat(preds)
    return {"samples": len(preds), "records": len(records), "same": sorted(map(tuple, preds.tolist())) ==
            sorted(records), "predicted": [p for _, p in sorted(records)]}


def main():
    parser = argparse.ArgumentParser(description="Uneven data: split batches, padded last batch, even_batches.")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, dataloader_config=DataLoaderConfiguration(split_batches=True),
                              gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    set_seed(7)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    train_dataloader = DataLoader(Points(45, seed=1), batch_size=8, shuffle=True)
    eval_dataloader = DataLoader(Points(45, seed=2), batch_size=8)
    # with split_batches the prepared loader has the same length, and the scheduler steps once per optimizer step
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.05, total_steps=len(train_dataloader) // 2 * args.num_epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accelerator.even_batches = False  # for loaders prepared from here on
    uneven_dataloader = accelerator.prepare(DataLoader(Points(45, seed=3), batch_size=8))

    lrs, epochs = [], []
    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                lrs.append(lr_scheduler.get_last_lr()[0])
        metrics = evaluate(accelerator, model, eval_dataloader)
        accelerator.print(f"epoch {epoch}:", metrics)
        epochs.append(metrics)
    epochs.append(evaluate_uneven(accelerator, model, uneven_dataloader))

    params = torch.cat([p.detach().float().flatten().cpu() for p in accelerator.unwrap_model(model).parameters()])
    accelerator.print("COMPAT " + json.dumps({
        "script": "split_uneven_metrics", "num_processes": accelerator.num_processes,
        "batches_per_rank": [len(train_dataloader), len(eval_dataloader), len(uneven_dataloader)],
        "lrs": lrs, "params": params.tolist(), "metrics": epochs}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
