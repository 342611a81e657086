"""The default collator and the column pruning for datasets.Dataset."""
from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from impel.config.run_config import ConfigError
from impel.trainer.collate import default_data_collator, remove_unused_columns
from trainer_helpers import tiny_bert


def test_dict_samples_are_stacked_and_labels_renamed():
    batch = default_data_collator([{"input_ids": [1, 2], "label": 0, "text": "a"},
                                   {"input_ids": [3, 4], "label": 1, "text": "b"}])
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2], [3, 4]]))
    assert torch.equal(batch["labels"], torch.tensor([0, 1]))
    assert batch["text"] == ["a", "b"]


def test_tuples_use_torch_default_collate():
    x, y = default_data_collator([(torch.ones(2), 0), (torch.zeros(2), 1)])
    assert x.shape == (2, 2) and y.tolist() == [0, 1]


def test_ragged_columns_name_the_fix():
    with pytest.raises(ConfigError, match="padding collator"):
        default_data_collator([{"input_ids": [1, 2]}, {"input_ids": [3]}])


def test_unused_columns_of_a_datasets_dataset_are_removed():
    ds = Dataset.from_dict({"text": ["a", "b"], "input_ids": [[1, 2], [3, 4]], "attention_mask": [[1, 1], [1, 1]],
                            "label": [0, 1], "play": ["x", "y"]})
    pruned = remove_unused_columns(ds, tiny_bert(), ["labels"])
    assert sorted(pruned.column_names) == ["attention_mask", "input_ids", "label"]
    batch = default_data_collator([pruned[0], pruned[1]])
    assert batch["labels"].tolist() == [0, 1] and batch["input_ids"].shape == (2, 2)


def test_a_dataset_without_model_inputs_raises():
    ds = Dataset.from_dict({"text": ["a"], "play": ["x"]})
    with pytest.raises(ConfigError, match="remove_unused_columns=False"):
        remove_unused_columns(ds, tiny_bert(), ["labels"])


def test_torch_datasets_are_left_alone():
    data = [{"x": 1}]
    assert remove_unused_columns(data, tiny_bert(), ["labels"]) is data
