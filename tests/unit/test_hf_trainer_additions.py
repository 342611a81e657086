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
    from impel.trainer import hf_resume
    from impel.trainer.hf import Trainer

    full = _trainer(tmp_path / "full")
    full.train()
    assert all(hf_resume.is_complete(tmp_path / "full" / f"checkpoint-{n}") for n in (3, 6))

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
    assert half.is_dir() and not hf_resume.is_complete(half)  # transformers' get_last_checkpoint would take it
    assert hf_resume.classify(half) == "cut short"  # impel's marker, written before transformers wrote anything
    assert hf_resume.newest_complete_checkpoint(tmp_path / "crash") == str(tmp_path / "crash" / "checkpoint-3")

    resumed = _trainer(tmp_path / "crash")
    resumed.train(resume_from_checkpoint="auto")
    assert _max_diff(resumed.model.state_dict(), full.model.state_dict()) == 0.0
    assert hf_resume.is_complete(half)  # written again, whole


def test_a_truncated_file_makes_a_checkpoint_incomplete(tmp_path):
    from impel.trainer import hf_resume

    _trainer(tmp_path / "run").train()
    newest = tmp_path / "run" / "checkpoint-6"
    weights = next(p for p in newest.iterdir() if p.name.startswith("model"))
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    assert hf_resume.newest_complete_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "checkpoint-3")


def test_auto_starts_from_scratch_without_a_checkpoint_and_true_raises(tmp_path):
    trainer = _trainer(tmp_path / "fresh")
    assert trainer.train(resume_from_checkpoint="auto").global_step == 6
    with pytest.raises(ValueError, match="No valid checkpoint found.*impel_complete.json.*trainer_state.*'auto'"):
        _trainer(tmp_path / "empty").train(resume_from_checkpoint=True)


def _transformers_trainer(output_dir):
    """transformers' own Trainer (on Accelerate), the same run as :func:`_trainer`: its checkpoints carry no marker."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=5e-3, use_cpu=True, report_to=[], disable_tqdm=True,
                             save_strategy="steps", save_steps=3, seed=3, logging_steps=1)
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data())


def test_auto_adopts_checkpoints_transformers_wrote_and_deletes_none(tmp_path, capsys):
    """A script moved over from transformers' Trainer, run on the same output_dir: its checkpoints have no impel
    marker, which is no proof of a crash: "auto" (and True) resume from the newest, and nothing is removed."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class StopAfterTheFirstSave(TrainerCallback):  # transformers' run ends at checkpoint-3; impel goes on to 6
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = True

    run = tmp_path / "run"
    hf = _transformers_trainer(run)
    hf.add_callback(StopAfterTheFirstSave())
    hf.train()
    before = sorted(p.name for p in run.iterdir())
    assert f"{PREFIX_CHECKPOINT_DIR}-3" in before
    resumed = _trainer(run)
    resumed.train(resume_from_checkpoint="auto")
    assert "resuming from" in capsys.readouterr().out and (run / "checkpoint-3" / "trainer_state.json").exists()
    assert set(before) <= {p.name for p in run.iterdir()}  # nothing of transformers' is gone
    full = _trainer(tmp_path / "full")
    full.train()
    assert _max_diff(resumed.model.state_dict(), full.model.state_dict()) == 0.0
    from impel.trainer import hf_resume

    assert hf_resume.resolve_resume(True, str(run), False) == str(run / "checkpoint-6")  # True: the newest too
    assert hf_resume.classify(run / "checkpoint-3") == "foreign"


def test_a_changed_file_in_a_complete_checkpoint_is_refused_never_removed(tmp_path):
    from impel.config.run_config import ConfigError

    run = tmp_path / "run"
    _trainer(run).train()
    config = run / "checkpoint-6" / "config.json"
    config.write_text(config.read_text().replace("{", '{"note": "mine", ', 1))
    with pytest.raises(ConfigError, match=r"checkpoint-6 was saved complete by impel but these files changed since: "
                                          r"config.json; impel neither removes nor skips it"):
        _trainer(run).train(resume_from_checkpoint="auto")
    assert '"note": "mine"' in config.read_text() and (run / "checkpoint-3").is_dir()


def test_a_damaged_or_foreign_folder_given_by_path_is_refused_naming_it(tmp_path):
    from impel import Accelerator
    from impel.config.run_config import ConfigError

    run = tmp_path / "run"
    _trainer(run).train()
    weights = run / "checkpoint-6" / "model.safetensors"
    (run / "checkpoint-6" / "impel_complete.json").unlink()  # as if written by transformers: no marker to compare
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ConfigError, match=r"model.safetensors is damaged .*resume from another checkpoint"):
        _trainer(run).train(resume_from_checkpoint=str(run / "checkpoint-6"))
    acc = Accelerator(cpu=True)
    acc.prepare(tiny_gpt2())
    acc.save_state(tmp_path / "state")
    with pytest.raises(ConfigError, match=r"is an Accelerator.save_state checkpoint .*accelerator.load_state"):
        _trainer(tmp_path / "other").train(resume_from_checkpoint=str(tmp_path / "state"))
