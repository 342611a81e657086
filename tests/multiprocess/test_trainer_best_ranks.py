"""``load_best_model_at_end`` on 2 CPU ranks: DDP, FSDP (sharded checkpoints) and DeepSpeed ZeRO-2 pick the same
best step as one process and end with its weights; rotation happens once, on the process that writes."""
from __future__ import annotations

import importlib.util

import pytest

from helpers import max_abs_diff
from impel.testing import run_on_ranks
from trainer_helpers import TokenDataset, tiny_bert

pytestmark = pytest.mark.multiprocess

# tests/unit/test_trainer_best.py's run: eval_loss is lowest at step 2 of 10. 10 eval samples in batches of 5 fill
# both ranks exactly: with a padded last batch the padding samples' losses would enter its mean (as in transformers)
# and could move a close best
RUN = {"max_steps": 10, "per_device_eval_batch_size": 5, "learning_rate": 1e-2, "seed": 7, "logging_steps": 2,
       "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
       "load_best_model_at_end": True, "save_total_limit": 2, "disable_tqdm": True, "report_to": "none",
       "plot_loss": False}


def _train_best(output_dir: str, **knobs):
    from pathlib import Path

    from impel import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, use_cpu=True, **dict(RUN, **knobs))
    trainer = Trainer(tiny_bert(), args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(10, seed=1))
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}
    kept = sorted(p.name for p in (Path(output_dir) / "checkpoints").iterdir())
    return {"weights": weights, "best_step": trainer.state.best_global_step, "kept": kept,
            "steps": sorted(trainer.state.checkpoints), "type": str(trainer.accelerator.distributed_type)}


def _deepspeed_ready() -> bool:
    import impel.config.plugins

    return hasattr(impel.config.plugins, "DeepSpeedPlugin") and importlib.util.find_spec("deepspeed") is not None


STRATEGIES = {
    "MULTI_CPU": {},
    "FSDP": {"fsdp": "full_shard auto_wrap", "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}},
    "DEEPSPEED": {"deepspeed": {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}},
}


@pytest.mark.parametrize("strategy", [
    "MULTI_CPU", "FSDP",
    pytest.param("DEEPSPEED", marks=pytest.mark.skipif(not _deepspeed_ready(), reason="deepspeed not installed")),
])
def test_best_model_on_two_ranks_equals_one_process(tmp_path, strategy):
    knobs = dict(STRATEGIES[strategy], per_device_train_batch_size=2)
    ranks = run_on_ranks(_train_best, 2, args=(str(tmp_path / "ranks"),), kwargs=knobs, timeout=150)
    one = _train_best(str(tmp_path / "one"), per_device_train_batch_size=4)  # the same global batch
    for r in ranks:
        assert r["type"] == strategy
        assert r["best_step"] == one["best_step"] == 2
        assert r["steps"] == one["steps"] == [2, 10] and r["kept"] == ["checkpoint_0", "checkpoint_4"]
        assert max_abs_diff(r["weights"], one["weights"]) <= 1e-5
    assert max_abs_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
