"""Callbacks and TrainerControl, checked against transformers' own Trainer on the same tiny BERT, data and seed:
the order of events (with the flags and keyword arguments each sees), control objects set or returned by callbacks,
early stopping, and transformers' own callback objects running inside impel's Trainer."""
from __future__ import annotations

import logging

import pytest
import transformers

from helpers import max_abs_diff
from impel import TrainerCallback
from impel.config.run_config import ConfigError
from impel.trainer import EarlyStoppingCallback, TrainerControl
from trainer_helpers import (
    TokenDataset,
    impel_trainer,
    scripted_metric,
    tiny_bert,
    trained_weights,
    transformers_trainer,
)

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict",
          "on_save", "on_log", "on_prediction_step")
FLAGS = ("should_log", "should_evaluate", "should_save", "should_training_stop", "should_epoch_stop")


class Recorder(transformers.TrainerCallback):
    """A user's transformers callback: records every event with the step, the control flags and the kwargs."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []


def _recording(event: str):
    def method(self, args, state, control, **kwargs):
        self.seen.append((event, state.global_step, tuple(getattr(control, f) for f in FLAGS), tuple(sorted(kwargs))))
    return method


for _event in EVENTS:
    setattr(Recorder, _event, _recording(_event))

# 20 samples, batch 4, accumulation 2: 3 optimizer steps per epoch (2, 2 and 1 micro-steps), 2 epochs
RUN = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 6, "learning_rate": 3e-3,
       "seed": 7, "logging_steps": 2, "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps",
       "save_steps": 2, "per_device_eval_batch_size": 8}


def _data():
    return {"train_dataset": TokenDataset(), "eval_dataset": TokenDataset(10, seed=1)}


def test_event_order_flags_and_kwargs_match_transformers(tmp_path):
    # max_steps is a multiple of logging_steps: impel always logs the last step, transformers only on the interval
    theirs, ours = Recorder(), Recorder()
    transformers_trainer(tmp_path / "hf", tiny_bert(), RUN, callbacks=[theirs], **_data()).train()
    impel_trainer(tmp_path / "impel", tiny_bert(), RUN, callbacks=[ours], **_data()).train()
    assert len(ours.seen) == len(theirs.seen) == 54
    assert ours.seen == theirs.seen


class ControlsTheLoop:
    """Written once, for both Trainers: sets flags at step 3 (no strategy would act there) and returns a new
    control object that stops training at step 5."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            control.should_log = control.should_evaluate = control.should_save = True
        if state.global_step == 5:
            replacement = type(control)()
            replacement.should_training_stop = True
            return replacement
        return None


class ImpelControls(ControlsTheLoop, TrainerCallback):
    pass


class HFControls(ControlsTheLoop, transformers.TrainerCallback):
    pass


def test_control_set_or_returned_by_a_callback_acts_as_in_transformers(tmp_path):
    knobs = dict(RUN, gradient_accumulation_steps=1, max_steps=10, logging_steps=100, eval_strategy="no",
                 save_strategy="no")
    hf = transformers_trainer(tmp_path / "hf", tiny_bert(), knobs, callbacks=[HFControls], **_data())
    hf.train()
    ours = impel_trainer(tmp_path / "impel", tiny_bert(), knobs, callbacks=[ImpelControls], **_data())
    ours.train()
    assert hf.state.global_step == ours.state.global_step == 5
    for key in ("loss", "eval_loss"):
        assert [r["step"] for r in hf.state.log_history if key in r] == [3]
        assert [r["step"] for r in ours.state.log_history if key in r] == [3]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]
    assert list(ours.state.checkpoints) == [3]
    assert max_abs_diff(trained_weights(ours), trained_weights(hf)) <= 1e-6


# --- early stopping -----------------------------------------------------------------------------------------------
# patience 2, threshold 0.05: 0.6 improves on 0.5; 0.62 by too little (1); 0.7 resets; 0.71 by too little (1) but is
# the new best; 0.705 (2): stop at the 6th evaluation, step 12 (without the threshold: step 14). The best is 0.71 at
# step 10, which load_best_model_at_end restores.
SCORES = [0.5, 0.6, 0.62, 0.7, 0.71, 0.705, 0.6, 0.6, 0.6, 0.6]
EARLY = dict(RUN, gradient_accumulation_steps=1, max_steps=20, metric_for_best_model="score",
             load_best_model_at_end=True, save_total_limit=2)


@pytest.mark.parametrize("callback", ["impel", "transformers"])
def test_early_stopping_matches_transformers(tmp_path, callback):
    hf_stop = transformers.EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.05)
    hf = transformers_trainer(tmp_path / "hf", tiny_bert(), EARLY, compute_metrics=scripted_metric(SCORES),
                              callbacks=[hf_stop], **_data())
    hf.train()
    cls = EarlyStoppingCallback if callback == "impel" else transformers.EarlyStoppingCallback
    stop = cls(early_stopping_patience=2, early_stopping_threshold=0.05)
    ours = impel_trainer(tmp_path / "impel", tiny_bert(), EARLY, compute_metrics=scripted_metric(SCORES),
                         callbacks=[stop], **_data())
    ours.train()
    assert hf.state.global_step == ours.state.global_step == 12
    assert hf_stop.early_stopping_patience_counter == stop.early_stopping_patience_counter == 2
    assert hf.state.best_global_step == ours.state.best_global_step == 10
    assert hf.state.best_metric == ours.state.best_metric == 0.71
    assert max_abs_diff(trained_weights(ours), trained_weights(hf)) <= 1e-5


def test_early_stopping_needs_metric_for_best_model_as_in_transformers(tmp_path, caplog):
    knobs = dict(RUN, max_steps=2)
    hf = transformers_trainer(tmp_path / "hf", tiny_bert(), knobs, callbacks=[transformers.EarlyStoppingCallback()],
                              **_data())
    with pytest.raises(AssertionError, match="requires metric_for_best_model"):
        hf.train()
    ours = impel_trainer(tmp_path / "impel", tiny_bert(), knobs, callbacks=[EarlyStoppingCallback()], **_data())
    with caplog.at_level(logging.WARNING, logger="impel"), pytest.raises(ConfigError,
                                                                         match="requires metric_for_best_model"):
        ours.train()
    assert "without load_best_model_at_end=True" in caplog.text  # a warning, as in transformers


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("restore, stops_at", [(True, 8), (False, 10)])
def test_early_stopping_counter_survives_resume_when_asked(tmp_path, restore, stops_at):
    # the score only falls: evaluations at 2, 4, 6, 8 leave the counter at 0, 1, 2, 3 -> patience 3 stops at step 8
    knobs = dict(RUN, gradient_accumulation_steps=1, max_steps=20, metric_for_best_model="score",
                 restore_callback_states_from_checkpoint=restore)
    falling = [0.5, 0.4, 0.3, 0.2, 0.1, 0.0, -0.1]
    full = impel_trainer(tmp_path / "full", tiny_bert(), knobs, compute_metrics=scripted_metric(falling),
                         callbacks=[EarlyStoppingCallback(3)], **_data())
    full.train()
    assert full.state.global_step == 8
    cut = impel_trainer(tmp_path / "cut", tiny_bert(), knobs, compute_metrics=scripted_metric(falling),
                        callbacks=[EarlyStoppingCallback(3), _StopAt(5)], **_data())
    cut.train()  # the checkpoint at step 4 holds the counter (1) and the best score (0.5)
    stop = EarlyStoppingCallback(3)
    resumed = impel_trainer(tmp_path / "cut", tiny_bert(), knobs, compute_metrics=scripted_metric(falling[2:]),
                            callbacks=[stop], **_data())
    resumed.train(resume_from_checkpoint=True)  # the newest checkpoint: step 4
    assert resumed.state.global_step == stops_at and stop.early_stopping_patience_counter == 3


# --- managing callbacks ---------------------------------------------------------------------------------------------
def test_add_pop_and_remove_callbacks(tmp_path):
    trainer = impel_trainer(tmp_path, tiny_bert(), dict(RUN, eval_strategy="no"), train_dataset=TokenDataset())
    first = EarlyStoppingCallback()
    trainer.add_callback(first)
    trainer.add_callback(EarlyStoppingCallback)  # a class is instantiated
    recorder = Recorder()
    trainer.add_callback(recorder)
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names == ["ProgressCallback", "EarlyStoppingCallback", "EarlyStoppingCallback", "Recorder"]
    assert trainer.pop_callback(EarlyStoppingCallback) is first
    assert trainer.pop_callback(first) is None
    trainer.remove_callback(recorder)
    trainer.remove_callback(EarlyStoppingCallback)
    assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks] == ["ProgressCallback"]
    with pytest.raises(TypeError, match="none of the TrainerCallback events"):
        trainer.add_callback(object())


def test_should_epoch_stop_starts_the_next_epoch(tmp_path):
    class CutEpochs(TrainerCallback):
        ends: list[tuple[int, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            control.should_epoch_stop = True  # every epoch stops after its first optimizer step

        def on_epoch_end(self, args, state, control, **kwargs):
            self.ends.append((state.global_step, control.should_epoch_stop))

    knobs = dict(RUN, gradient_accumulation_steps=1, max_steps=3, eval_strategy="no", save_strategy="no")
    trainer = impel_trainer(tmp_path, tiny_bert(), knobs, callbacks=[CutEpochs], train_dataset=TokenDataset())
    trainer.train()
    # impel trains max_steps (transformers would stop after ceil(max_steps / steps per epoch) short epochs)
    assert CutEpochs.ends == [(1, True), (2, True), (3, True)]
    assert trainer.train_dataloader.epoch == 2 and isinstance(trainer.control, TrainerControl)
