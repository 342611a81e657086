"""transformers' Trainer on impel's Accelerator, 2 CPU ranks: token-level losses exact across ranks and
accumulation, and the same numbers as transformers' Trainer on Accelerate under the same launch."""
from __future__ import annotations

import pytest

from hf_trainer_helpers import max_diff, run_script, run_script_on_rank
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}  # else Accelerate on a CPU box under torchrun trains unsynchronised
SGD = {"optim": "sgd", "learning_rate": 0.5, "max_steps": 3, "do_eval": False, "gradient_checkpointing": False}


def test_two_ranks_by_4_with_accumulation_2_equal_one_process_of_16(tmp_path):
    one = run_script("impel.trainer.hf", str(tmp_path / "one"), per_device_train_batch_size=16, **SGD)
    ranks = run_on_ranks(run_script_on_rank, 2, args=("impel.trainer.hf", str(tmp_path / "ranks"),
                                        dict(SGD, per_device_train_batch_size=4, gradient_accumulation_steps=2)),
                         timeout=150)
    for result in ranks:
        assert result["world"] == 2 and result["accelerator"] == "impel.accelerator.facade"
        assert max_diff(result["weights"], one["weights"]) <= 1e-6
        assert result["loss"] == pytest.approx(one["loss"], abs=1e-6)


def test_the_example_script_on_two_ranks_gives_transformers_numbers(tmp_path):
    knobs = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    knobs = dict(knobs, do_predict=True)  # predict(): every sample once, in order, on both ranks
    reference = run_on_ranks(run_script_on_rank, 2, args=("transformers", str(tmp_path / "hf"), knobs),
                             env=ACCELERATE_ENV, timeout=150)[0]
    ours = run_on_ranks(run_script_on_rank, 2, args=("impel", str(tmp_path / "impel"), knobs), timeout=150)[0]
    assert (reference["world"], ours["world"]) == (2, 2)
    assert (reference["accelerator"], ours["accelerator"]) == ("accelerate.accelerator", "impel.accelerator.facade")
    assert max_diff(ours["weights"], reference["weights"]) <= 1e-5
    for key in ("eval_loss", "loss", "learning_rate"):
        assert ours[key] == pytest.approx(reference[key], abs=1e-6), key
    assert ours["tokens_seen"] == reference["tokens_seen"] == 6 * 2 * 2 * 4 * 16
    assert ours["predictions"].shape == reference["predictions"].shape == (12, 16, 64)
    assert (ours["predictions"] - reference["predictions"]).abs().max().item() <= 1e-5
    assert ours["test_loss"] == pytest.approx(reference["test_loss"], abs=1e-6)


@pytest.mark.parametrize("state_dict_type, files", [
    ("FULL_STATE_DICT", {"pytorch_model_fsdp.bin", "optimizer.bin"}),
    ("SHARDED_STATE_DICT", {"pytorch_model_fsdp_0", "optimizer_0"}),
])
def test_the_fsdp_knob_trains_like_one_process_and_resumes_exactly(tmp_path, state_dict_type, files):
    """fsdp="full_shard" on 2 ranks: impel's FSDP2 runs transformers' loop; its checkpoints (Accelerate's layout,
    written by impel.trainer.hf_fsdp) resume mid-epoch to the uninterrupted run's weights."""
    knobs = {"gradient_checkpointing": False, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    one = run_script("impel.trainer.hf", str(tmp_path / "one"), **dict(knobs, per_device_train_batch_size=8))
    fsdp = dict(knobs, fsdp="full_shard", save_strategy="steps", save_steps=3,
                fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": state_dict_type})
    full = run_on_ranks(run_script_on_rank, 2, args=("impel.trainer.hf", str(tmp_path / "fsdp"), fsdp), timeout=150)[0]
    resumed = run_on_ranks(run_script_on_rank, 2, args=("impel.trainer.hf", str(tmp_path / "resumed"),
                                          dict(fsdp, resume_from_checkpoint=str(tmp_path / "fsdp" / "checkpoint-3"))),
                           timeout=150)[0]
    assert full["world"] == 2 and full["global_step"] == resumed["global_step"] == 6
    assert max_diff(full["weights"], one["weights"]) <= 1e-5
    assert full["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert files <= {name.split("/")[1] for name in full["files"] if name.startswith("checkpoint-3/")}
    assert max_diff(resumed["weights"], full["weights"]) == 0.0


def test_parallelism_config_dp_shard_runs_fsdp_on_impels_mesh_like_one_process(tmp_path):
    """TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=2), fsdp=...) on 2 ranks: impel's
    FSDP2 over the mesh's dp_shard dim trains like one process with the same global batch."""
    from accelerate import ParallelismConfig

    knobs = {"gradient_checkpointing": False, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    one = run_script("impel.trainer.hf", str(tmp_path / "one"), **dict(knobs, per_device_train_batch_size=8))
    mesh = dict(knobs, fsdp="full_shard", parallelism_config=ParallelismConfig(dp_shard_size=2),
                fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]})
    ranks = run_on_ranks(run_script_on_rank, 2, args=("impel.trainer.hf", str(tmp_path / "mesh"), mesh), timeout=150)[0]
    assert ranks["world"] == 2 and ranks["distributed_type"] == "FSDP" and ranks["mesh"] == (1, 2)
    assert max_diff(ranks["weights"], one["weights"]) <= 1e-5
    assert ranks["loss"] == pytest.approx(one["loss"], abs=1e-6)


@pytest.mark.parametrize("knob", [{}, {"fsdp": "full_shard", "fsdp_config": {
    "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": "SHARDED_STATE_DICT"}}], ids=["ddp", "fsdp"])
def test_the_best_checkpoint_on_two_ranks_is_one_process_best(tmp_path, knob):
    """load_best_model_at_end with save_total_limit=1 on 2 ranks (DDP, and FSDP with sharded checkpoints loaded
    back through impel.trainer.hf_fsdp): one process's best step, kept checkpoints and final weights."""
    knobs = {"gradient_checkpointing": False, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
             "learning_rate": 0.3, "max_steps": 8, "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
             "save_total_limit": 1, "load_best_model_at_end": True, "metric_for_best_model": "eval_loss",
             "do_eval": False}
    one = run_script("impel", str(tmp_path / "one"), **dict(knobs, per_device_train_batch_size=8))
    ranks = run_on_ranks(run_script_on_rank, 2, args=("impel", str(tmp_path / "ranks"), dict(knobs, **knob)),
                         timeout=150)
    best_step = one["best"][1]
    assert best_step < 8  # the best is not the newest: the rotation and the final load have a choice
    for result in ranks:
        assert result["world"] == 2 and result["best"][1:] == one["best"][1:]
        # the eval loss itself depends on the number of ranks under transformers' Trainer on Accelerate too
        # (measured, eval batch 1: 3.509 on 2 ranks vs 3.438 on one after 2 steps whose weights agree to 1e-6)
        assert result["best"][0] == min(result["eval_loss"][:4])
        assert {name.split("/")[0] for name in result["files"]} == {f"checkpoint-{best_step}"}
        assert max_diff(result["weights"], one["weights"]) <= 1e-5
