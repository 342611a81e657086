"""``resume_from_checkpoint`` continues exactly: same weights, same log history, same metrics file."""
from __future__ import annotations

import json

import pytest

from helpers import max_abs_diff
from impel import Trainer, TrainerCallback, TrainingArguments
from impel.checkpoint import CheckpointError
from trainer_helpers import TokenDataset, tiny_bert

VOLATILE = ("_runtime", "_per_second")  # wall-clock numbers differ between any two runs


def _args(out, **overrides):
    values = {"output_dir": str(out), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
              "max_steps": 7, "learning_rate": 3e-3, "warmup_steps": 2, "weight_decay": 0.1, "logging_steps": 2,
              "eval_strategy": "steps", "eval_steps": 3, "save_strategy": "steps", "save_steps": 3, "seed": 7,
              "disable_tqdm": True, "plot_loss": False}
    values.update(overrides)
    return TrainingArguments(**values)


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True  # a crash after this step: nothing more is saved


def _run(out, stop_at=None, resume=None, **overrides):
    trainer = Trainer(tiny_bert(dropout=0.1), _args(out, **overrides), train_dataset=TokenDataset(),
                      eval_dataset=TokenDataset(10, seed=1), callbacks=[StopAt(stop_at)] if stop_at else None)
    trainer.train(resume_from_checkpoint=resume)
    weights = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    return trainer, {k: v.detach().clone() for k, v in weights.items()}


def _stable(rows):
    return [{k: v for k, v in row.items() if not k.endswith(VOLATILE)} for row in rows]


@pytest.mark.parametrize("save_steps", [3, 2])  # 3: the checkpoint falls on an epoch's last batch; 2: mid-epoch
def test_resume_true_continues_exactly(tmp_path, save_steps):
    full, full_weights = _run(tmp_path / "full", save_steps=save_steps)
    _run(tmp_path / "cut", stop_at=5, save_steps=save_steps)
    resumed, resumed_weights = _run(tmp_path / "cut", resume=True, save_steps=save_steps)
    assert max_abs_diff(resumed_weights, full_weights) == 0.0
    assert resumed.state.global_step == 7
    assert _stable(resumed.state.log_history) == _stable(full.state.log_history)
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert _stable(rows) == _stable(full.state.log_history)


def test_resume_from_an_explicit_checkpoint(tmp_path):
    _, full_weights = _run(tmp_path / "full")
    cut, _ = _run(tmp_path / "cut", stop_at=5)
    checkpoint = cut.state.last_checkpoint
    assert checkpoint.endswith("checkpoint_0")
    _, resumed_weights = _run(tmp_path / "other", resume=checkpoint)
    assert max_abs_diff(resumed_weights, full_weights) == 0.0


def test_resume_true_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _run(tmp_path / "empty", resume=True)


def test_auto_resume_from_the_launch_config_continues_exactly(tmp_path, monkeypatch, capsys):
    """`impel launch --auto_resume`: the Trainer resumes by itself, before it plans its loop."""
    from impel.runtime.process import ProcessState

    _, full_weights = _run(tmp_path / "full")
    _run(tmp_path / "cut", stop_at=5)
    ProcessState._reset()
    monkeypatch.setenv("IMPEL_CONFIG", json.dumps({"auto_resume": True}))
    capsys.readouterr()
    resumed, resumed_weights = _run(tmp_path / "cut")
    assert "auto_resume: resumed from" in capsys.readouterr().out and resumed.state.global_step == 7
    assert max_abs_diff(resumed_weights, full_weights) == 0.0
