"""Pieces of the evaluation loop: splitting model outputs, and collecting gathered predictions.

Predictions and labels of every batch are padded across ranks along dim 1 (with -100, as transformers does),
gathered with ``gather_for_metrics`` (which drops the samples even batches duplicated), moved to the CPU and
concatenated; batches whose dim 1 differs are padded with -100 to the longest.

Example::

    collected = Collected()
    collected.add(gathered_logits, gathered_labels)
    prediction = collected.prediction()   # EvalPrediction(numpy predictions, numpy label_ids)
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from impel.trainer.state import EvalPrediction

PAD_INDEX = -100


def model_loss(outputs: Any, loss_first: bool = False) -> torch.Tensor | None:
    """The loss in a model's outputs: ``outputs["loss"]`` (transformers' ModelOutput is a mapping), the first
    element of a tuple when ``loss_first``, else None."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    if loss_first and isinstance(outputs, (tuple, list)) and outputs:
        return outputs[0]
    return getattr(outputs, "loss", None)


def model_predictions(outputs: Any, loss_first: bool = False) -> Any:
    """Everything a model returned except its loss: one tensor, or a tuple of them (None entries dropped).

    ``loss_first``: a tuple output starts with the loss (transformers models with ``return_dict=False`` given
    labels)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        values = [v for k, v in outputs.items() if k != "loss" and v is not None]
    elif isinstance(outputs, (tuple, list)):
        values = [v for v in outputs[1 if loss_first else 0:] if v is not None]
    else:
        return None
    values = [v for v in values if isinstance(v, torch.Tensor)]
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def batch_labels(batch: Any, label_names: Sequence[str]) -> Any:
    """The batch's label tensor (or a tuple of them for several label names); None when there are none."""
    if not isinstance(batch, Mapping):
        return None
    found = [batch[name] for name in label_names if name in batch]
    if not found:
        return None
    return found[0] if len(found) == 1 else tuple(found)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch (dim 0 of its first tensor)."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return int(value.shape[0])
    raise TypeError(f"cannot tell the batch size of {type(batch).__name__}; batches must hold tensors")


def to_numpy(data: Any) -> Any:
    """Tensors (nested in tuples) to numpy; low-precision floats become float32 first."""
    if isinstance(data, (tuple, list)):
        return tuple(to_numpy(d) for d in data)
    if data is None:
        return None
    tensor = data.detach().cpu()
    if tensor.is_floating_point() and tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.float()
    return tensor.numpy()


def concat_padded(chunks: list[np.ndarray]) -> np.ndarray:
    """Concatenate along dim 0; when dim 1 differs between chunks, pad it with -100 to the longest."""
    if len(chunks) == 1 or chunks[0].ndim < 2 or len({c.shape[1:] for c in chunks}) == 1:
        return np.concatenate(chunks, axis=0)
    width = max(c.shape[1] for c in chunks)
    padded = []
    for c in chunks:
        out = np.full((c.shape[0], width, *c.shape[2:]), PAD_INDEX, dtype=c.dtype)
        out[:, :c.shape[1]] = c
        padded.append(out)
    return np.concatenate(padded, axis=0)


class Collected:
    """Gathered predictions and labels of an evaluation, batch by batch, on the CPU."""

    def __init__(self) -> None:
        self.predictions: list[Any] = []
        self.labels: list[Any] = []

    def add(self, predictions: Any, labels: Any) -> None:
        if predictions is not None:
            self.predictions.append(to_numpy(predictions))
        if labels is not None:
            self.labels.append(to_numpy(labels))

    @staticmethod
    def _join(parts: list[Any]) -> Any:
        if not parts:
            return None
        if isinstance(parts[0], tuple):
            return tuple(concat_padded([p[i] for p in parts]) for i in range(len(parts[0])))
        return concat_padded(parts)

    def prediction(self) -> EvalPrediction:
        return EvalPrediction(self._join(self.predictions), self._join(self.labels))


class EvalLoopOutput(NamedTuple):
    """What :func:`evaluate_batches` (and ``Trainer.evaluation_loop``) return, as transformers' EvalLoopOutput."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]
    num_samples: int


def evaluate_batches(accelerator: Any, model: torch.nn.Module, loader: Any,
                     forward: Callable[[Any, bool], tuple[Any, Any]], label_names: Sequence[str],
                     compute_metrics: Callable[[EvalPrediction], Mapping[str, float]] | None,
                     prefix: str = "eval", collect: bool | None = None, ignore_keys: Sequence[str] = (),
                     on_batch: Callable[[], None] | None = None) -> EvalLoopOutput:
    """Run ``forward(batch, has_labels) -> (loss, outputs)`` over a prepared loader without gradients.

    The loss is averaged over samples (each batch's mean loss counts once per sample in it), from every rank, each
    sample once. Predictions (outputs except the loss and ``ignore_keys``) and labels are gathered when ``collect``
    (default: when there is a ``compute_metrics``), which runs on every rank with identical arrays when both exist.
    ``on_batch`` runs after each batch (``on_prediction_step``).
    """
    was_training = model.training
    model.eval()
    collected = Collected() if (compute_metrics is not None if collect is None else collect) else None
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # loss over samples, samples
    samples = batches = 0
    started = time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            labels = batch_labels(batch, label_names)
            loss, outputs = forward(batch, labels is not None)
            size = batch_size_of(batch)
            if loss is not None:
                per_sample = accelerator.gather_for_metrics(loss.detach().double().reshape(1).repeat(size))
                totals += torch.stack([per_sample.sum(), totals.new_tensor(per_sample.numel())])
            if collected is not None:
                if ignore_keys and isinstance(outputs, Mapping):
                    outputs = {k: v for k, v in outputs.items() if k not in ignore_keys}
                parts = {"predictions": model_predictions(outputs, loss_first=labels is not None), "labels": labels}
                parts = {k: v for k, v in parts.items() if v is not None}
                parts = accelerator.pad_across_processes(parts, dim=1, pad_index=PAD_INDEX)
                parts = accelerator.gather_for_metrics(parts)
                collected.add(parts.get("predictions"), parts.get("labels"))
            samples += size
            batches += 1
            if on_batch is not None:
                on_batch()
    model.train(was_training)
    runtime = time.perf_counter() - started
    prediction = collected.prediction() if collected is not None else EvalPrediction(None, None)
    metrics: dict[str, float] = {}
    if compute_metrics is not None and prediction.predictions is not None and prediction.label_ids is not None:
        for key, value in compute_metrics(prediction).items():
            metrics[key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"] = float(value)
    if totals[1] > 0:
        metrics[f"{prefix}_loss"] = float(totals[0] / totals[1])
    num_samples = int(totals[1]) if totals[1] > 0 else _gathered_count(accelerator, samples, prediction)
    metrics[f"{prefix}_runtime"] = round(runtime, 4)
    if runtime > 0:
        metrics[f"{prefix}_samples_per_second"] = round(num_samples / runtime, 3)
        metrics[f"{prefix}_steps_per_second"] = round(batches / runtime, 3)
    return EvalLoopOutput(prediction.predictions, prediction.label_ids, metrics, num_samples)


def _gathered_count(accelerator: Any, samples: int, prediction: EvalPrediction) -> int:
    """Samples over all ranks when no loss counted them: the gathered predictions' length, else the sum."""
    first = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    if first is not None:
        return len(first)
    return int(accelerator.reduce(torch.tensor(samples, device=accelerator.device), "sum"))
