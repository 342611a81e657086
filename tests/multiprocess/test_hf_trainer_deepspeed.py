"""transformers' ``deepspeed=`` knob on impel's Accelerator (``impel.trainer.hf``): ZeRO-2 and ZeRO-3 give
transformers' Trainer on Accelerate's DeepSpeed numbers, and a run resumed from a checkpoint ends where the
uninterrupted one does.

The reference is transformers' Trainer on Accelerate 1.15 with the same DeepSpeed JSON, on one process: Accelerate
cannot run DeepSpeed on more than one CPU rank (its process state finds no backend on a machine without GPUs unless
``cpu=True``, which turns DeepSpeed off and trains DDP instead), so impel's 2 ranks (4 sequences each) are compared
with its one process of 8 (the same global batch: the token-level loss makes them equal up to reduction order).

Tolerances: one process, the same arithmetic: equal to 1e-6 (bitwise on this machine). 2 ranks vs one process:
weights 1e-5 (ZeRO reduce-scatters fp32 gradients in another order; 3.4e-6 seen), train losses 1e-6, the learning
rate trace and tokens seen exactly. The eval loss is not compared across world sizes: transformers averages batch
means, and the 12-sample eval set splits into other batches on 2 ranks.
"""
from __future__ import annotations

import pytest

from hf_trainer_helpers import max_diff, run_script_on_rank
from impel.testing import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("deepspeed")

KNOBS = {"gradient_accumulation_steps": 2, "gradient_checkpointing": False}


def _json(stage: int) -> dict:
    # ZeRO-3 with no persistence threshold: every parameter is partitioned (DeepSpeed keeps ones under 1e5
    # elements whole by default, which is all of this tiny model's)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def _on(world, source, output_dir, **overrides):
    return run_on_ranks(run_script_on_rank, world, args=(source, output_dir, dict(KNOBS, **overrides)), timeout=300)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_gives_transformers_numbers_on_one_process_and_on_two_ranks(tmp_path, stage):
    # Accelerate runs DeepSpeed only with use_cpu=False (cpu=True turns it off); impel's CPU DeepSpeed wants use_cpu
    reference = _on(1, "transformers", str(tmp_path / "hf"), deepspeed=_json(stage), use_cpu=False,
                    per_device_train_batch_size=8)
    one = _on(1, "impel.trainer.hf", str(tmp_path / "one"), deepspeed=_json(stage), per_device_train_batch_size=8)
    ranks = _on(2, "impel.trainer.hf", str(tmp_path / "ranks"), deepspeed=_json(stage),
                per_device_train_batch_size=4)
    assert reference["distributed_type"] == one["distributed_type"] == ranks["distributed_type"] == "DEEPSPEED"
    assert (reference["accelerator"], ranks["accelerator"]) == ("accelerate.accelerator", "impel.accelerator.facade")
    assert ranks["world"] == 2
    assert max_diff(one["weights"], reference["weights"]) <= 1e-6
    for key in ("eval_loss", "loss", "learning_rate", "grad_norm"):
        assert one[key] == pytest.approx(reference[key], abs=1e-6), key
    assert max_diff(ranks["weights"], reference["weights"]) <= 1e-5
    assert ranks["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    assert ranks["grad_norm"] == pytest.approx(reference["grad_norm"], abs=1e-5)
    assert ranks["learning_rate"] == reference["learning_rate"] and len(ranks["learning_rate"]) == 6
    assert ranks["tokens_seen"] == reference["tokens_seen"] == 6 * 2 * 8 * 16


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_weights(tmp_path, stage):
    """2 ranks; checkpoint-3 is DeepSpeed's engine checkpoint (global_step3/, written by every rank) plus
    transformers' files; the resumed run continues mid-epoch and ends bitwise where the uninterrupted one did."""
    knobs = {"deepspeed": _json(stage), "per_device_train_batch_size": 4, "save_strategy": "steps", "save_steps": 3}
    full = _on(2, "impel.trainer.hf", str(tmp_path / "full"), **knobs)
    resumed = _on(2, "impel.trainer.hf", str(tmp_path / "resumed"),
                  resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"), **knobs)
    assert {"checkpoint-3/global_step3", "checkpoint-3/scheduler.pt", "checkpoint-3/rng_state_1.pth",
            "checkpoint-3/impel_complete.json"} <= \
        set(full["files"])
    assert full["global_step"] == resumed["global_step"] == 6
    assert max_diff(resumed["weights"], full["weights"]) == 0.0
    assert resumed["loss"] == full["loss"]


def test_use_cpu_false_on_a_cpu_machine_raises_naming_the_fix(tmp_path):
    """transformers then builds Accelerate's DeepSpeed process state, which finds no backend without GPUs and
    counts one process: the JSON's batch sizes, logging and saving would be one rank's."""
    import torch

    from impel.testing import RankFailed

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: Accelerate's process state finds the ranks")
    # Accelerate's state is checked against impel's when impel's Accelerator is built (accelerate_state.mirror): the
    # first error names both counts and the fix
    with pytest.raises(RankFailed, match=r"sees process 0 of 1 .*Accelerator runs process \d of 2.*use_cpu=True"):
        _on(2, "impel.trainer.hf", str(tmp_path / "run"), deepspeed=_json(2), use_cpu=False,
            per_device_train_batch_size=4)
