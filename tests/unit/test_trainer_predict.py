"""``Trainer.predict``: transformers' ``PredictionOutput`` with ``test_`` metrics, checked against transformers'
own Trainer after the same training (the 2-rank check is tests/multiprocess/test_trainer_predict_ranks.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from impel import TrainerCallback
from impel.trainer import PredictionOutput
from trainer_helpers import TokenDataset, impel_trainer, tiny_bert, transformers_trainer

RUN = {"per_device_train_batch_size": 4, "max_steps": 4, "learning_rate": 3e-3, "seed": 7, "logging_steps": 2,
       "save_strategy": "no", "per_device_eval_batch_size": 3}


def accuracy(pred):
    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}


class Unlabeled(torch.utils.data.Dataset):
    def __init__(self, data: TokenDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.data[i].items() if k != "labels"}


class PredictEvents:
    def __init__(self) -> None:
        self.metrics: list[dict] = []

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append(dict(metrics))


class HFEvents(PredictEvents, transformers.TrainerCallback):
    pass


class ImpelEvents(PredictEvents, TrainerCallback):
    pass


def _speed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}


def test_predict_matches_transformers(tmp_path):
    test = TokenDataset(11, seed=2)  # 11 samples in batches of 3: a short last batch
    hf_events, our_events = HFEvents(), ImpelEvents()
    hf = transformers_trainer(tmp_path / "hf", tiny_bert(), RUN, train_dataset=TokenDataset(),
                              compute_metrics=accuracy, callbacks=[hf_events])
    hf.train()
    ours = impel_trainer(tmp_path / "impel", tiny_bert(), RUN, train_dataset=TokenDataset(),
                         compute_metrics=accuracy, callbacks=[our_events])
    ours.train()
    history = list(ours.state.log_history)
    theirs, mine = hf.predict(test), ours.predict(test)
    assert isinstance(mine, PredictionOutput) and mine._fields == theirs._fields
    assert mine.predictions.shape == theirs.predictions.shape == (11, 2)
    assert np.abs(mine.predictions - theirs.predictions).max() <= 1e-5
    assert np.array_equal(mine.label_ids, theirs.label_ids) and mine.label_ids.tolist() == test.labels.tolist()
    assert mine.metrics.keys() == theirs.metrics.keys() == {"test_loss", "test_accuracy", "test_runtime",
                                                           "test_samples_per_second", "test_steps_per_second"}
    assert mine.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], abs=1e-6)
    assert mine.metrics["test_accuracy"] == theirs.metrics["test_accuracy"]
    assert ours.state.log_history == history  # predict() does not log, as in transformers
    assert _speed(our_events.metrics[0]) == _speed(mine.metrics) and len(hf_events.metrics) == 1

    # without labels: no label_ids, no loss, no compute_metrics; another prefix
    theirs = hf.predict(Unlabeled(test), metric_key_prefix="unlabeled")
    mine = ours.predict(Unlabeled(test), metric_key_prefix="unlabeled")
    assert mine.label_ids is None and theirs.label_ids is None
    assert mine.metrics.keys() == theirs.metrics.keys() == {"unlabeled_runtime", "unlabeled_samples_per_second",
                                                           "unlabeled_steps_per_second"}
    assert np.abs(mine.predictions - theirs.predictions).max() <= 1e-5


def test_predict_is_not_part_of_the_checkpointed_state(tmp_path):
    trainer = impel_trainer(tmp_path, tiny_bert(), dict(RUN, max_steps=1), train_dataset=TokenDataset())
    trainer.train()
    loaders = len(trainer.accelerator._dataloaders)
    trainer.predict(TokenDataset(5, seed=2))
    assert len(trainer.accelerator._dataloaders) == loaders  # the one-off loader is dropped again
    predictions, label_ids, metrics = trainer.predict(TokenDataset(5, seed=2))  # unpacks like transformers'
    assert predictions.shape == (5, 2) and label_ids.shape == (5,) and "test_loss" in metrics
