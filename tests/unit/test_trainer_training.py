"""Single-process Trainer runs: the numeric reference, what a run writes, datasets.Dataset input, trackers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from datasets import Dataset

from helpers import max_abs_diff
from impel import Trainer, TrainerCallback, TrainingArguments
from impel.config.run_config import ConfigError
from trainer_helpers import TokenDataset, reference_trainer_loop, tiny_bert

RECIPE = {"learning_rate": 3e-3, "warmup_steps": 2, "weight_decay": 0.1, "max_grad_norm": 0.5, "seed": 7,
          "lr_scheduler_type": "linear", "disable_tqdm": True, "report_to": "none"}


def _args(tmp_path, **overrides):
    values = dict(RECIPE, output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_steps=7, logging_steps=2, save_strategy="no", plot_loss=False)
    values.update(overrides)
    return TrainingArguments(**values)


def accuracy(pred):
    true_class = pred.predictions[np.arange(len(pred.label_ids)), pred.label_ids]  # needs predictions aligned to labels
    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean()),
            "true_class_logit": float(true_class.mean())}


def test_trainer_equals_a_hand_written_loop(tmp_path):
    # 20 samples, batch 4, accumulation 2: groups of 2, 2, 1 micro-steps per epoch (the short one still steps);
    # 7 optimizer steps cross two epoch boundaries, with warmup, weight decay and clipping
    reference = reference_trainer_loop(tiny_bert(), TokenDataset(), global_batch=4, accumulation=2, max_steps=7,
                                       lr=3e-3, warmup=2, weight_decay=0.1, max_grad_norm=0.5, seed=7)
    trainer = Trainer(tiny_bert(), _args(tmp_path), train_dataset=TokenDataset())
    output = trainer.train()
    assert output.global_step == 7 and trainer.state.epoch == pytest.approx(2 + 2 / 5)  # batches, as transformers
    trained = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    assert max_abs_diff(trained, reference) <= 1e-6


def test_a_run_writes_metrics_plot_and_summary(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = _args(tmp_path, eval_strategy="steps", eval_steps=3, plot_loss=True)
    trainer = Trainer(tiny_bert(), args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(10, seed=1),
                      compute_metrics=accuracy)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6, 7]  # every logging_steps, and the last step
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6, 7]
    # the last evaluation ran on the final weights: its loss and metrics are the ones computed here by hand
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    data = TokenDataset(10, seed=1)
    with torch.no_grad():
        logits = model(input_ids=data.ids, attention_mask=torch.ones_like(data.ids)).logits
    last = [r for r in rows if "eval_loss" in r][-1]
    assert last["eval_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, data.labels)), rel=1e-5)
    assert last["eval_accuracy"] == pytest.approx(float((logits.argmax(-1) == data.labels).float().mean()))
    assert last["eval_true_class_logit"] == pytest.approx(float(logits[torch.arange(10), data.labels].mean()),
                                                          rel=1e-5)
    assert rows[-1]["train_loss"] > 0 and rows == trainer.state.log_history
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    out = capsys.readouterr().out
    assert "impel Trainer: 7/7 optimizer steps" in out and "loss plot:" in out and "eval_accuracy=" in out


def test_evaluate_gathers_every_sample_once(tmp_path):
    seen = []

    def metrics(pred):
        seen.append(pred)
        return {"n": len(pred.label_ids)}

    trainer = Trainer(tiny_bert(), _args(tmp_path, per_device_eval_batch_size=4), eval_dataset=TokenDataset(10, 1),
                      compute_metrics=metrics)
    result = trainer.evaluate()
    assert result["eval_n"] == 10 and seen[0].predictions.shape == (10, 2)
    _, labels = seen[0]  # EvalPrediction unpacks like a tuple
    assert labels.tolist() == TokenDataset(10, 1).labels.tolist()
    assert result["eval_loss"] > 0


def test_datasets_dataset_with_extra_columns_trains(tmp_path):
    data = TokenDataset()
    ds = Dataset.from_dict({"input_ids": data.ids.tolist(), "label": data.labels.tolist(),
                            "text": [f"row {i}" for i in range(len(data))]})
    trainer = Trainer(tiny_bert(), _args(tmp_path, max_steps=3), train_dataset=ds)
    assert trainer.train_dataset.column_names == ["input_ids", "label"]
    assert trainer.train().global_step == 3


def test_callbacks_see_the_loop_and_can_stop_it(tmp_path):
    events = []

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            events.append(state.global_step)
            if state.global_step == 4:
                control.should_training_stop = True

    trainer = Trainer(tiny_bert(), _args(tmp_path), train_dataset=TokenDataset(), callbacks=[Recorder])
    assert trainer.train().global_step == 4 and events == [1, 2, 3, 4]


def test_tracker_asked_for_but_missing_names_the_install(tmp_path, monkeypatch):
    import impel.trackers.registry

    monkeypatch.setitem(impel.trackers.registry.PACKAGES, "wandb", ("impel_no_such_module", "wandb"))
    with pytest.raises(ConfigError, match="pip install wandb"):
        Trainer(tiny_bert(), _args(tmp_path, report_to=["wandb"]), train_dataset=TokenDataset())


def test_tensorboard_tracker_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    trainer = Trainer(tiny_bert(), _args(tmp_path, max_steps=2, report_to="tensorboard"), train_dataset=TokenDataset())
    trainer.train()
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))


def test_plot_required_without_matplotlib_raises(tmp_path, monkeypatch):
    import impel.trainer.plot

    monkeypatch.setattr(impel.trainer.plot, "matplotlib_available", lambda: False)
    trainer = Trainer(tiny_bert(), _args(tmp_path, max_steps=1, plot_loss=True), train_dataset=TokenDataset())
    with pytest.raises(ConfigError, match=r"impel\[plot\]"):
        trainer.train()


def test_eval_strategy_without_eval_dataset_raises(tmp_path):
    with pytest.raises(ConfigError, match="needs an eval_dataset"):
        Trainer(tiny_bert(), _args(tmp_path, eval_strategy="epoch"), train_dataset=TokenDataset())


def test_tuple_batches_name_the_fix(tmp_path):
    data = torch.utils.data.TensorDataset(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    trainer = Trainer(tiny_bert(), _args(tmp_path, max_steps=1), train_dataset=data)
    with pytest.raises(ConfigError, match="override compute_loss"):
        trainer.train()


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_knob_trains_under_autocast(tmp_path, bf16):
    model = tiny_bert()
    seen = []  # the dtype a Linear inside the model computes in, at every training forward
    model.classifier.register_forward_hook(lambda module, args, out: seen.append((module.training, out.dtype)))
    trainer = Trainer(model, _args(tmp_path, max_steps=2, gradient_accumulation_steps=1, bf16=bf16),
                      train_dataset=TokenDataset())
    assert trainer.accelerator.mixed_precision == ("bf16" if bf16 else "no")
    assert trainer.train().global_step == 2 and trainer.state.log_history[0]["loss"] > 0
    assert seen == [(True, torch.bfloat16 if bf16 else torch.float32)] * 2
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast, not a bf16 model
