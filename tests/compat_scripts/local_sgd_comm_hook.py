"""Accelerate's ``examples/by_feature/local_sgd.py`` and ``ddp_comm_hook.py`` together, shrunk to a tiny BERT.

Written as an Accelerate user writes it (``tests/multiprocess/test_compat_scripts.py`` runs it as is under torchrun,
and renamed to impel under ``impel launch``): the model is wrapped with DDP's fp16-compression communication hook
(``DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)``); the first epochs train with
``LocalSGD`` (no gradient all-reduce, parameters averaged every ``local_sgd_steps``), the later ones accumulate
two batches by hand, skipping the gradient all-reduce of the first with ``accelerator.no_sync(model)`` in one epoch
and with the DDP model's own ``model.no_sync()`` in the next, clipping with ``clip_grad_norm_`` before each step.

Prints one line ``COMPAT {json}`` on the main process: the learning rate after every optimizer step, the final
parameters and the metrics of every epoch.
"""
import argparse
import json
import random

import torch
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, set_seed
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

VOCAB, LENGTH = 32, 8


def make_split(num_samples, seed):
    """Token sequences; label 1 when the first half sums higher than the second."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        ids = [rng.randrange(1, VOCAB) for _ in range(LENGTH)]
        rows.append({"input_ids": torch.tensor(ids), "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                     "labels": torch.tensor(int(sum(ids[:LENGTH // 2]) > sum(ids[LENGTH // 2:])))})
    return rows


def training_function(config, args):
    ddp_kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(args.ddp_comm_hook))
    accelerator = Accelerator(cpu=args.cpu, kwargs_handlers=[ddp_kwargs])
    set_seed(config["seed"])
    train_dataloader = DataLoader(make_split(32, seed=5), shuffle=True, batch_size=config["batch_size"])
    eval_dataloader = DataLoader(make_split(20, seed=6), shuffle=False, batch_size=config["batch_size"])
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=LENGTH, num_labels=2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
    lr_scheduler = get_linear_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=2,
                                                   num_training_steps=len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    lrs, epochs = [], []
    for epoch in range(config["num_epochs"]):
        model.train()
        if epoch < config["local_sgd_epochs"]:
            with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=args.local_sgd_steps,
                          enabled=args.local_sgd_steps is not None) as local_sgd:
                for batch in train_dataloader:
                    with accelerator.accumulate(model):
                        output = model(**batch)
                        accelerator.backward(output.loss)
                        optimizer.step()
                        lr_scheduler.step()
                        optimizer.zero_grad()
                        local_sgd.step()
                    lrs.append(lr_scheduler.get_last_lr()[0])
        else:
            # accumulate by hand: the first of two batches keeps its gradients local (no all-reduce)
            skip_sync = accelerator.no_sync if epoch % 2 == 0 else (lambda ddp_model: ddp_model.no_sync())
            for step, batch in enumerate(train_dataloader):
                if step % 2 == 0:
                    with skip_sync(model):
                        accelerator.backward(model(**batch).loss / 2)
                    continue
                accelerator.backward(model(**batch).loss / 2)  # all-reduced through the fp16 hook
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                lrs.append(lr_scheduler.get_last_lr()[0])

        model.eval()
        correct, total, loss_sum = 0, 0, torch.zeros((), device=accelerator.device)
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references = accelerator.gather_for_metrics((outputs.logits.argmax(dim=-1),
                                                                      batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
            loss_sum += outputs.loss.detach() * batch["labels"].numel()
        eval_metric = {"accuracy": correct / total, "samples": total,
                       "summed_loss": accelerator.reduce(loss_sum, reduction="sum").item()}
        accelerator.print(f"epoch {epoch}:", eval_metric)
        epochs.append(eval_metric)

    params = torch.cat([p.detach().float().flatten().cpu() for p in accelerator.unwrap_model(model).parameters()])
    accelerator.print("COMPAT " + json.dumps({
        "script": "local_sgd_comm_hook", "num_processes": accelerator.num_processes, "lrs": lrs,
        "params": params.tolist(), "metrics": epochs}))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="LocalSGD and a DDP communication hook, tiny.")
    parser.add_argument("--local_sgd_steps", type=int, default=3)
    parser.add_argument("--ddp_comm_hook", type=str, default="fp16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": 4, "local_sgd_epochs": 2, "seed": 42, "batch_size": 4}
    training_function(config, args)


if __name__ == "__main__":
    main()
