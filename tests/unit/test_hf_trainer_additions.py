"""impel's additions on transformers' Trainer (``impel.trainer.hf``, callbacks in ``impel.trainer.hf_callbacks``):
metrics.jsonl and the loss plot, checkpoints marked complete, and ``resume_from_checkpoint="auto"``. They change no
number: the run with them equals transformers' Trainer on Accelerate (test_hf_trainer.py), and a run resumed
after a crash mid-save ends with the uninterrupted run's weights, bitwise."""
from __future__ import annotations

import json
import os

import pytest

from hf_trainer_helpers import padded_lm_data, tiny_gpt2


def _trainer(output_dir, **kwargs):
    from impel.trainer.hf import Trainer, TrainingArguments

    plot = kwargs.pop("plot_loss", False)
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=5e-3, use_cpu=True, report_to=[], disable_tqdm=True,
                             save_strategy="steps", save_steps=3, seed=3, logging_steps=1, **kwargs)
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(), plot_loss=plot)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_metrics_jsonl_holds_the_log_history_and_the_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    trainer = _trainer(tmp_path / "run", plot_loss=True)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == json.loads(json.dumps(trainer.state.log_history))
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    quiet = _trainer(tmp_path / "quiet", plot_loss=False)
    quiet.train()
    assert not (tmp_path / "quiet" / "loss.png").exists() and (tmp_path / "quiet" / "metrics.jsonl").exists()


def test_compare_reads_the_metrics(tmp_path):
    from impel.commands.compare import Run

    _trainer(tmp_path / "run").train()
    run = Run.load("run", tmp_path / "run", None)
    # 4 x accumulation 2, from the summary row (transformers rounds its speeds to 4 decimals)
    assert run.samples_per_step == pytest.approx(8.0, rel=1e-3)


def test_a_crash_mid_save_is_never_resumed_and_auto_resume_ends_bitwise(tmp_path, monkeypatch):
    from impel.trainer import hf_callbacks
    from impel.trainer.hf import Trainer

    full = _trainer(tmp_path / "full")
    full.train()
    assert all(hf_callbacks.is_complete(tmp_path / "full" / f"checkpoint-{n}") for n in (3, 6))

    crashing = _trainer(tmp_path / "crash")
    original = Trainer._save_rng_state

    def crash_at_step_6(self, output_dir):
        if self.state.global_step == 6:
            raise KeyboardInterrupt("killed mid-save")  # after the weights and optimizer, before the rest
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", crash_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    monkeypatch.undo()
    half = tmp_path / "crash" / "checkpoint-6"
    assert half.is_dir() and not hf_callbacks.is_complete(half)  # transformers' get_last_checkpoint would take it
    assert hf_callbacks.newest_complete_checkpoint(tmp_path / "crash") == str(tmp_path / "crash" / "checkpoint-3")

    resumed = _trainer(tmp_path / "crash")
    resumed.train(resume_from_checkpoint="auto")
    assert _max_diff(resumed.model.state_dict(), full.model.state_dict()) == 0.0
    assert hf_callbacks.is_complete(half)  # written again, whole


def test_a_truncated_file_makes_a_checkpoint_incomplete(tmp_path):
    from impel.trainer import hf_callbacks

    _trainer(tmp_path / "run").train()
    newest = tmp_path / "run" / "checkpoint-6"
    weights = next(p for p in newest.iterdir() if p.name.startswith("model"))
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    assert hf_callbacks.newest_complete_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "checkpoint-3")


def test_auto_starts_from_scratch_without_a_checkpoint_and_true_raises(tmp_path):
    trainer = _trainer(tmp_path / "fresh")
    assert trainer.train(resume_from_checkpoint="auto").global_step == 6
    with pytest.raises(ValueError, match="No valid checkpoint found.*impel_complete.json.*'auto'"):
        _trainer(tmp_path / "empty").train(resume_from_checkpoint=True)
