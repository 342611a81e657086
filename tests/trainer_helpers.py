"""A tiny BERT classifier, its data, and a hand-written loop: the numeric reference for the Trainer's tests."""
from __future__ import annotations

import math

import torch
from torch import nn

SEQ = 8


def tiny_bert(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """A 2-layer BertForSequenceClassification built from a config (no download); dropout off by default."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


class TokenDataset(torch.utils.data.Dataset):
    """Random token rows; the label says whether the first token is in the upper half of the vocabulary."""

    def __init__(self, n: int = 20, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 40, (n, SEQ), generator=g)
        self.labels = (self.ids[:, 0] >= 20).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Written out independently of impel: no decay on biases and LayerNorm weights."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            (no_decay if isinstance(module, nn.LayerNorm) or name == "bias" else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def reference_trainer_loop(model: nn.Module, dataset: TokenDataset, *, global_batch: int, accumulation: int,
                           max_steps: int, lr: float, warmup: int, weight_decay: float, max_grad_norm: float,
                           seed: int) -> dict[str, torch.Tensor]:
    """What the Trainer should compute: each epoch's order is ``randperm(n)`` seeded by ``seed + epoch`` (impel's
    documented seedable shuffle); accumulation groups end at the epoch's end and divide by their real length; a
    linear schedule with warmup; AdamW; gradient clipping at every optimizer step."""
    opt = torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr)

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier)
    step, epoch = 0, 0
    while step < max_steps:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        batches = [order[i:i + global_batch] for i in range(0, len(order), global_batch)]
        for g in range(0, len(batches), accumulation):
            group = batches[g:g + accumulation]
            for idx in group:
                rows = [dataset[i] for i in idx]
                batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
                (model(**batch).loss / len(group)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step == max_steps:
                break
        epoch += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def steps_per_epoch(n: int, global_batch: int, accumulation: int) -> int:
    return math.ceil(math.ceil(n / global_batch) / accumulation)


# --- transformers' own Trainer, the behavioural reference of impel's ------------------------------------------
def transformers_trainer(output_dir, model: nn.Module, knobs: dict, **kwargs):
    """``transformers.Trainer`` on the same knobs, on the CPU, reporting nowhere."""
    import transformers

    args = transformers.TrainingArguments(output_dir=str(output_dir), use_cpu=True, report_to="none",
                                          disable_tqdm=True, **knobs)
    return transformers.Trainer(model, args, **kwargs)


def impel_trainer(output_dir, model: nn.Module, knobs: dict, **kwargs):
    """impel's Trainer on the same knobs (no plot, no progress bar)."""
    from impel import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), report_to="none", disable_tqdm=True, plot_loss=False,
                             **knobs)
    return Trainer(model, args, **kwargs)


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    """The model's weights after training, for either Trainer."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def scripted_metric(values: list[float], name: str = "score"):
    """A ``compute_metrics`` that returns ``values[i]`` at the i-th evaluation: a known metric sequence."""
    calls = iter(values)

    def compute_metrics(prediction) -> dict[str, float]:
        return {name: next(calls)}

    return compute_metrics
