"""The best checkpoint, checked against transformers' own Trainer on the same tiny BERT, data and seed.

At these learning rates training is numerically comparable (the two Trainers' weights agree to ~2e-6 after 10
steps at lr 1e-2, ~1e-7 at 3e-3; at 5e-2 AdamW's first steps amplify float noise in near-zero gradients to 3e-4),
so the tests compare the chosen step, the best metric, which checkpoints rotation keeps, and the final weights after
``load_best_model_at_end`` (<= 1e-5), and check that impel's final weights are bitwise the best checkpoint's.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import max_abs_diff
from impel import TrainerCallback, TrainingArguments
from trainer_helpers import (
    TokenDataset,
    impel_trainer,
    scripted_metric,
    tiny_bert,
    trained_weights,
    transformers_trainer,
)

# lr 1e-2 over 10 steps: eval_loss 0.68786, 0.69786, 0.69261, 0.69181, 0.69079 -> the best is step 2, the runner-up
# the last; the model moves on for 8 steps after it
LOSS_RUN = {"per_device_train_batch_size": 4, "max_steps": 10, "learning_rate": 1e-2, "seed": 7, "logging_steps": 2,
            "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
            "load_best_model_at_end": True}


def _data():
    return {"train_dataset": TokenDataset(), "eval_dataset": TokenDataset(10, seed=1)}


def _hf_steps(out: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in out.iterdir() if p.name.startswith("checkpoint-")}


def _impel_steps(trainer) -> set[int]:
    """Steps of the checkpoints impel kept; the map must describe exactly the directories on disk."""
    root = Path(trainer.args.output_dir) / "checkpoints"
    on_disk = {p.name for p in root.iterdir()} if root.is_dir() else set()
    assert on_disk == {Path(p).name for p in trainer.state.checkpoints.values()}
    return set(trainer.state.checkpoints)


def _step_of(trainer, path: str) -> int:
    return {p: s for s, p in trainer.state.checkpoints.items()}[path]


def test_load_best_model_at_end_matches_transformers(tmp_path):
    knobs = dict(LOSS_RUN, save_total_limit=1)  # keeps newest + best while training, only the best at the end
    hf = transformers_trainer(tmp_path / "hf", tiny_bert(), knobs, **_data())
    hf.train()
    ours = impel_trainer(tmp_path / "impel", tiny_bert(), knobs, **_data())
    ours.train()
    assert ours.args.metric_for_best_model == hf.args.metric_for_best_model == "loss"
    assert ours.args.greater_is_better is hf.args.greater_is_better is False
    assert hf.state.best_global_step == ours.state.best_global_step == 2
    assert ours.state.best_metric == pytest.approx(hf.state.best_metric, abs=1e-6)
    assert hf.state.best_model_checkpoint.endswith("checkpoint-2")
    assert _step_of(ours, ours.state.best_model_checkpoint) == 2
    assert _hf_steps(tmp_path / "hf") == _impel_steps(ours) == {2}
    final = trained_weights(ours)
    assert max_abs_diff(final, trained_weights(hf)) <= 1e-5
    saved = load_file(os.path.join(ours.state.best_model_checkpoint, "model.safetensors"))
    assert all(torch.equal(final[k], saved[k]) for k in saved) and saved.keys() == final.keys()
    # the model moved on after step 2 (the last evaluation is worse): loading the best changed it
    assert ours.state.global_step == 10 and ours.state.log_history[-2]["eval_loss"] > ours.state.best_metric + 0.002


def test_save_strategy_best_with_a_known_metric_sequence_matches_transformers(tmp_path):
    # "score" does not end in "loss": greater is better; 0.5 again at the 4th evaluation is not a new best
    scores = [0.2, 0.5, 0.4, 0.5, 0.9, 0.3]
    knobs = dict(LOSS_RUN, learning_rate=3e-3, max_steps=12, save_strategy="best", metric_for_best_model="score",
                 save_total_limit=2)
    hf = transformers_trainer(tmp_path / "hf", tiny_bert(), knobs, compute_metrics=scripted_metric(scores),
                              **_data())
    hf.train()
    ours = impel_trainer(tmp_path / "impel", tiny_bert(), knobs, compute_metrics=scripted_metric(scores), **_data())
    ours.train()
    assert ours.args.greater_is_better is hf.args.greater_is_better is True
    assert hf.state.best_global_step == ours.state.best_global_step == 10
    assert hf.state.best_metric == ours.state.best_metric == 0.9
    assert _hf_steps(tmp_path / "hf") == _impel_steps(ours) == {4, 10}  # saved at 2, 4, 10; two kept
    assert max_abs_diff(trained_weights(ours), trained_weights(hf)) <= 1e-5
    saved = load_file(os.path.join(ours.state.best_model_checkpoint, "model.safetensors"))
    assert all(torch.equal(trained_weights(ours)[k], v) for k, v in saved.items())


class _Saves(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def test_save_strategy_best_saves_only_on_a_new_best(tmp_path):
    saves = _Saves()
    knobs = dict(LOSS_RUN, learning_rate=3e-3, max_steps=12, save_strategy="best", metric_for_best_model="score")
    ours = impel_trainer(tmp_path, tiny_bert(), knobs, compute_metrics=scripted_metric([0.2, 0.5, 0.4, 0.5, 0.9, 0.3]),
                         callbacks=[saves], **_data())
    ours.train()
    assert saves.steps == [2, 4, 10] and _impel_steps(ours) == {2, 4, 10}


def test_rotation_without_a_best_keeps_the_newest(tmp_path):
    knobs = dict(LOSS_RUN, load_best_model_at_end=False, save_total_limit=2)
    ours = impel_trainer(tmp_path, tiny_bert(), knobs, **_data())
    ours.train()
    assert ours.state.best_model_checkpoint is None and _impel_steps(ours) == {8, 10}


def test_metric_for_best_model_without_load_best_still_tracks_and_protects(tmp_path):
    # transformers: best_metric / best_model_checkpoint follow metric_for_best_model alone; rotation keeps the best
    knobs = dict(LOSS_RUN, load_best_model_at_end=False, metric_for_best_model="loss", save_total_limit=2)
    ours = impel_trainer(tmp_path, tiny_bert(), knobs, **_data())
    ours.train()
    assert ours.state.best_global_step == 2 and _impel_steps(ours) == {2, 10}
    saved = load_file(os.path.join(ours.state.best_model_checkpoint, "model.safetensors"))
    assert not all(torch.equal(trained_weights(ours)[k], v) for k, v in saved.items())  # nothing was loaded


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_keeps_the_best_checkpoint(tmp_path):
    knobs = dict(LOSS_RUN, save_total_limit=2)
    full = impel_trainer(tmp_path / "full", tiny_bert(), knobs, **_data())
    full.train()
    impel_trainer(tmp_path / "cut", tiny_bert(), knobs, callbacks=[_StopAt(8)], **_data()).train()
    resumed = impel_trainer(tmp_path / "cut", tiny_bert(), knobs, **_data())
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.best_global_step == 2 and resumed.state.best_metric == full.state.best_metric
    assert Path(resumed.state.best_model_checkpoint).parent == tmp_path / "cut" / "checkpoints"
    assert _impel_steps(resumed) == _impel_steps(full) == {2, 10}
    assert max_abs_diff(trained_weights(resumed), trained_weights(full)) == 0.0


# --- arguments: transformers' defaults and errors ---------------------------------------------------------------
@pytest.mark.parametrize("knobs", [
    {"load_best_model_at_end": True},
    {"load_best_model_at_end": True, "metric_for_best_model": "accuracy"},
    {"load_best_model_at_end": True, "metric_for_best_model": "eval_loss"},
    {"metric_for_best_model": "f1"},
    {"load_best_model_at_end": True, "metric_for_best_model": "loss", "greater_is_better": True},
    {},
])
def test_best_model_defaults_equal_transformers(knobs):
    import transformers

    knobs = dict(knobs, eval_strategy="steps", save_strategy="steps", eval_steps=10, save_steps=20)
    theirs = transformers.TrainingArguments(output_dir="unused", use_cpu=True, **knobs)
    ours = TrainingArguments(**knobs)
    for name in ("load_best_model_at_end", "metric_for_best_model", "greater_is_better"):
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.parametrize("knobs, message", [
    ({"eval_strategy": "steps", "save_strategy": "epoch"}, "requires the save and eval strategy to match"),
    ({"eval_strategy": "no", "save_strategy": "steps"}, "requires the save and eval strategy to match"),
    ({"eval_strategy": "steps", "save_strategy": "steps", "eval_steps": 3, "save_steps": 4}, "round multiple"),
    ({"eval_strategy": "steps", "save_strategy": "steps", "eval_steps": 0.2, "save_steps": 4}, "multiple"),
])
def test_load_best_with_mismatched_strategies_raises_as_transformers(knobs, message):
    import transformers

    knobs = dict(knobs, load_best_model_at_end=True)
    with pytest.raises(ValueError, match=message):
        transformers.TrainingArguments(output_dir="unused", use_cpu=True, **knobs)
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**knobs)


def test_load_best_with_save_strategy_best_needs_no_matching_eval_steps():
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=3, save_strategy="best")
    assert args.save_strategy == "best" and args.metric_for_best_model == "loss"


def test_save_strategy_best_without_a_metric_raises_as_transformers(tmp_path):
    import transformers

    message = "metric_for_best_model` must be provided when using 'best' save_strategy"
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, save_strategy="best")
    with pytest.raises(ValueError, match=message):
        transformers.Trainer(tiny_bert(), hf_args, train_dataset=TokenDataset())
    with pytest.raises(ValueError, match=message):
        TrainingArguments(save_strategy="best")


def test_unknown_metric_for_best_model_names_the_metrics(tmp_path):
    knobs = dict(LOSS_RUN, max_steps=2, metric_for_best_model="accuracy")
    ours = impel_trainer(tmp_path, tiny_bert(), knobs, **_data())
    with pytest.raises(ValueError, match=r"'eval_accuracy', which is not in the evaluation metrics \['eval_loss'"):
        ours.train()
