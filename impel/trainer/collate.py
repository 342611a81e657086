"""Batches from samples: the default collator and the column pruning done for ``datasets.Dataset``.

Samples that are mappings (a ``datasets.Dataset`` row, a dict from a torch dataset) become a dict of stacked
tensors; ``label`` / ``label_ids`` are renamed ``labels`` (what transformers models take). Anything else (tuples,
tensors) goes through ``torch.utils.data.default_collate``.

Example::

    batch = default_data_collator([{"input_ids": [1, 2], "label": 0}, {"input_ids": [3, 4], "label": 1}])
    # {'input_ids': tensor([[1, 2], [3, 4]]), 'labels': tensor([0, 1])}
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from impel.config.run_config import ConfigError

logger = logging.getLogger("impel")

LABEL_KEYS = ("label", "label_ids", "labels")


def _as_tensor(values: list[Any], key: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    if isinstance(first, str):
        return values  # text stays a list; a model never takes it, compute_metrics might
    try:
        return torch.tensor(values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot batch column {key!r} ({exc}); its samples differ in length: pass a padding "
                          "collator (data_collator=DataCollatorWithPadding(tokenizer)) or pad when "
                          "tokenizing") from None


def default_data_collator(features: Sequence[Any]) -> Any:
    """Stack a list of samples into one batch (see the module docstring)."""
    if not features:
        raise ValueError("default_data_collator got an empty list of samples")
    if not isinstance(features[0], Mapping):
        return default_collate(list(features))
    batch: dict[str, Any] = {}
    for key in features[0]:
        values = [f[key] for f in features]
        if values[0] is None:
            continue
        name = "labels" if key in LABEL_KEYS else key
        if name in batch:
            raise ConfigError(f"the samples hold both {name!r} and {key!r}; keep one label column")
        batch[name] = _as_tensor(values, key)
    return batch


def padding_collator(processing_class: Any) -> Callable[[Sequence[Any]], Any]:
    """A collator that pads with ``processing_class.pad`` (a transformers tokenizer) and renames labels."""

    def collate(features: Sequence[Any]) -> Any:
        rows = [{("labels" if k in LABEL_KEYS else k): v for k, v in f.items()} for f in features]
        return dict(processing_class.pad(rows, return_tensors="pt"))

    return collate


def model_input_names(model: torch.nn.Module) -> set[str] | None:
    """The named arguments of ``model.forward`` (as transformers reads them: a ``**kwargs`` catch-all next to
    named arguments does not count); None when it has only catch-alls, so nothing can be told apart."""
    params = inspect.signature(model.forward).parameters
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    named = {name for name, p in params.items() if p.kind not in variadic}
    return named or None


def remove_unused_columns(dataset: Any, model: torch.nn.Module, label_names: Sequence[str] | None,
                          description: str = "training") -> Any:
    """Drop the columns of a ``datasets.Dataset`` that ``model.forward`` does not take (labels are kept).

    Other datasets are returned unchanged. Transformers does the same, so text columns and ids can stay in the
    dataset without breaking ``model(**batch)``.
    """
    column_names = getattr(dataset, "column_names", None)
    if column_names is None or not hasattr(dataset, "remove_columns"):
        return dataset
    accepted = model_input_names(model)
    if accepted is None:
        return dataset
    keep = accepted | set(LABEL_KEYS) | set(label_names or ())
    unused = [c for c in column_names if c not in keep]
    if not unused:
        return dataset
    if len(unused) == len(column_names):
        raise ConfigError(f"none of the {description} dataset's columns {column_names} is an argument of "
                          f"{type(model).__name__}.forward; rename them (e.g. input_ids, attention_mask, labels) or "
                          "set remove_unused_columns=False")
    logger.info("the %s dataset's columns %s are not arguments of %s.forward and were removed", description,
                ", ".join(unused), type(model).__name__)
    return dataset.remove_columns(unused)
