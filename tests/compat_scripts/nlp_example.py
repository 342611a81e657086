"""Accelerate's ``examples/nlp_example.py``, shrunk: a tiny BERT learns a paraphrase-like pair task.

Written as an Accelerate user writes it (``tests/multiprocess/test_compat_scripts.py`` runs it as is under torchrun,
and renamed to impel under ``impel launch``): a tokenizer's ``pad`` collate with the ``DistributedType`` /
mixed-precision padding branches, a shuffled train loader with ``drop_last``, dropout on, AdamW, a linear warmup
schedule sized from the *unprepared* loader as the example does, ``accumulate()`` over 2 batches, and an evaluation
whose last global batch is padded by the sampler and truncated again by ``gather_for_metrics``.

Prints one line ``COMPAT {json}`` on the main process: the learning rate after every optimizer step, the final
parameters and the metrics of every epoch.
"""
import argparse
import json
import random

import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)

NUM_WORDS = 40
EVAL_BATCH_SIZE = 8


def build_tokenizer():
    """A word-level tokenizer made in memory (nothing is downloaded), with BERT's special tokens."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(NUM_WORDS)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def make_split(num_samples, seed):
    """Sentence pairs: label 1 when the second sentence is a shuffle of the first (a paraphrase, roughly)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        first = [f"w{rng.randrange(NUM_WORDS)}" for _ in range(rng.randint(3, 9))]
        label = rng.random() < 0.5
        second = rng.sample(first, len(first)) if label else [f"w{rng.randrange(NUM_WORDS)}" for _ in first]
        rows.append({"sentence1": " ".join(first), "sentence2": " ".join(second), "label": int(label)})
    return rows


def get_dataloaders(accelerator, batch_size):
    tokenizer = build_tokenizer()

    def tokenize(rows):
        encoded = tokenizer([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], truncation=True,
                            max_length=None)
        return [{"input_ids": ids, "attention_mask": mask, "labels": r["label"]}
                for ids, mask, r in zip(encoded["input_ids"], encoded["attention_mask"], rows)]

    with accelerator.main_process_first():
        train_rows, eval_rows = tokenize(make_split(48, seed=1)), tokenize(make_split(30, seed=2))

    def collate_fn(examples):
        # TPUs want one fixed shape; mixed precision wants lengths that are multiples of 8
        max_length = 128 if accelerator.distributed_type == DistributedType.XLA else None
        pad_to_multiple_of = 8 if accelerator.mixed_precision != "no" else None
        return tokenizer.pad(examples, padding="longest", max_length=max_length,
                             pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")

    train_dataloader = DataLoader(train_rows, shuffle=True, collate_fn=collate_fn, batch_size=batch_size,
                                  drop_last=True)
    eval_dataloader = DataLoader(eval_rows, shuffle=False, collate_fn=collate_fn, batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=config["gradient_accumulation_steps"])
    lr, num_epochs, seed, batch_size = config["lr"], config["num_epochs"], config["seed"], config["batch_size"]

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    # the model is built after set_seed so the seed also decides its initial weights; dropout stays on
    model = BertForSequenceClassification(BertConfig(
        vocab_size=NUM_WORDS + 4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=2))
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    # sized from the loader before prepare(), as the example does: a prepared scheduler steps num_processes times
    # per optimizer step, so this schedule ends with the training
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=4,
        num_training_steps=(len(train_dataloader) * num_epochs) // accelerator.gradient_accumulation_steps)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    lrs, epochs = [], []
    for epoch in range(num_epochs):
        model.train()
        for batch in train_dataloader:
            batch.to(accelerator.device)
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                lrs.append(lr_scheduler.get_last_lr()[0])

        model.eval()
        correct, seen, losses = 0, 0, []
        for batch in eval_dataloader:
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            per_sample = torch.nn.functional.cross_entropy(outputs.logits, batch["labels"], reduction="none")
            predictions, references, per_sample = accelerator.gather_for_metrics(
                (predictions, batch["labels"], per_sample))
            correct += (predictions == references).sum().item()
            seen += references.numel()
            losses.append(per_sample)
        eval_metric = {"accuracy": correct / seen, "eval_loss": torch.cat(losses).mean().item(), "samples": seen}
        accelerator.print(f"epoch {epoch}:", eval_metric)
        epochs.append(eval_metric)

    unwrapped = accelerator.unwrap_model(model)
    params = torch.cat([p.detach().float().flatten().cpu() for p in unwrapped.parameters()])
    accelerator.print("COMPAT " + json.dumps({
        "script": "nlp_example", "multi_cpu": accelerator.distributed_type == DistributedType.MULTI_CPU,
        "num_processes": accelerator.num_processes, "lrs": lrs, "params": params.tolist(), "metrics": epochs}))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="A tiny nlp_example.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": 3, "seed": 42, "batch_size": 4, "gradient_accumulation_steps": 2}
    training_function(config, args)


if __name__ == "__main__":
    main()
