"""logging_strategy, eval_on_start, eval_delay and data_seed behave as in transformers' Trainer (both run here on
the same tiny BERT and data; the rows of the log history are compared step by step)."""
from __future__ import annotations

import pytest

from impel.config.run_config import ConfigError
from trainer_helpers import TokenDataset, impel_trainer, tiny_bert, transformers_trainer

# 8 samples, batch 4: 2 optimizer steps per epoch; 3 epochs
RUN = {"per_device_train_batch_size": 4, "max_steps": 6, "learning_rate": 3e-3, "seed": 7, "save_strategy": "no",
       "per_device_eval_batch_size": 8}


def _data():
    return {"train_dataset": TokenDataset(8), "eval_dataset": TokenDataset(8, seed=1)}


def _steps(trainer, key):
    return [r["step"] for r in trainer.state.log_history if key in r]


def _both(tmp_path, **knobs):
    hf = transformers_trainer(tmp_path / "hf", tiny_bert(), dict(RUN, **knobs), **_data())
    hf.train()
    ours = impel_trainer(tmp_path / "impel", tiny_bert(), dict(RUN, **knobs), **_data())
    ours.train()
    return hf, ours


@pytest.mark.parametrize("knobs, loss_steps, eval_steps", [
    ({"logging_strategy": "epoch", "eval_strategy": "epoch"}, [2, 4, 6], [2, 4, 6]),
    ({"logging_strategy": "no", "logging_first_step": True, "eval_strategy": "steps", "eval_steps": 1,
      "eval_delay": 4}, [1], [4, 5, 6]),
    ({"logging_steps": 2, "eval_strategy": "epoch", "eval_delay": 2, "eval_on_start": True}, [2, 4, 6], [0, 4, 6]),
])
def test_when_the_trainer_logs_and_evaluates_matches_transformers(tmp_path, knobs, loss_steps, eval_steps):
    hf, ours = _both(tmp_path, **knobs)
    assert _steps(hf, "loss") == _steps(ours, "loss") == loss_steps
    assert _steps(hf, "eval_loss") == _steps(ours, "eval_loss") == eval_steps
    assert _steps(ours, "train_loss") == [6]


def test_without_logging_train_loss_is_the_mean_over_the_run(tmp_path):
    ours = impel_trainer(tmp_path, tiny_bert(), dict(RUN, logging_strategy="no"), **_data())
    result = ours.train()
    assert _steps(ours, "loss") == [] and 0.3 < result.training_loss < 1.0  # not NaN: every step's loss counts
    logged = impel_trainer(tmp_path / "logged", tiny_bert(), dict(RUN, logging_steps=1), **_data())
    per_step = [r["loss"] for r in logged.train() and logged.state.log_history if "loss" in r]
    assert result.training_loss == pytest.approx(sum(per_step) / len(per_step), rel=1e-6)


def test_data_seed_sets_the_shuffle_and_seed_the_rest(tmp_path):
    def first_batch(**knobs):
        trainer = impel_trainer(tmp_path / str(knobs), tiny_bert(), dict(RUN, max_steps=1, **knobs), **_data())
        trainer._setup()
        return next(iter(trainer.train_dataloader))["input_ids"]

    assert first_batch(seed=7, data_seed=3).equal(first_batch(seed=11, data_seed=3))
    assert not first_batch(seed=7, data_seed=3).equal(first_batch(seed=7, data_seed=4))
    assert first_batch(seed=7).equal(first_batch(seed=9, data_seed=7))


def test_bad_interval_knobs_name_the_value(tmp_path):
    for knobs, message in [({"logging_strategy": "sometimes"}, "logging_strategy='sometimes'"),
                           ({"eval_delay": -1}, "eval_delay=-1"), ({"eval_on_start": 1}, "eval_on_start=1"),
                           ({"data_seed": -2}, "data_seed=-2")]:
        with pytest.raises(ConfigError, match=message):
            impel_trainer(tmp_path, tiny_bert(), dict(RUN, **knobs))
    trainer = impel_trainer(tmp_path, tiny_bert(), dict(RUN, eval_on_start=True), train_dataset=TokenDataset())
    with pytest.raises(ConfigError, match="eval_on_start=True needs an eval_dataset"):
        trainer.train()
