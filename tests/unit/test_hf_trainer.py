"""impel's Trainer (``from impel import Trainer``: transformers' Trainer on impel's Accelerator, ``impel.trainer.hf``):
the same numbers as on Accelerate's, its fields and members, and the generated table in docs/trainer.md."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from hf_trainer_helpers import padded_lm_data, run_script, tiny_gpt2
from impel.config.run_config import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs"
START, END = "<!-- hf-fields:start -->", "<!-- hf-fields:end -->"


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


MORE_FIELDS = {"label_smoothing_factor": 0.1, "auto_find_batch_size": True, "lr_scheduler_type": "cosine_with_min_lr",
               "lr_scheduler_kwargs": {"min_lr": 1e-3}, "optim": "adafactor", "max_grad_norm": 0.5,
               "weight_decay": 0.01, "logging_first_step": True, "eval_on_start": True}


@pytest.mark.parametrize("knobs", [{}, MORE_FIELDS], ids=["example", "more-fields"])
def test_an_example_style_script_gives_transformers_numbers_with_the_import_renamed(tmp_path, knobs):
    """``from transformers import Trainer, TrainingArguments`` -> ``from impel import ...``, nothing else changed."""
    reference = run_script("transformers", str(tmp_path / "hf"), do_predict=True, **knobs)
    ours = run_script("impel", str(tmp_path / "impel"), do_predict=True, **knobs)
    assert (reference["accelerator"], ours["accelerator"]) == ("accelerate.accelerator", "impel.accelerator.facade")
    assert _max_diff(ours["weights"], reference["weights"]) <= 1e-5
    for key in ("eval_loss", "loss", "learning_rate"):
        assert ours[key] == pytest.approx(reference[key], abs=1e-6), key
    assert ours["predictions"].shape == reference["predictions"].shape == (12, 16, 64)  # predict(): every sample
    assert (ours["predictions"] - reference["predictions"]).abs().max().item() <= 1e-5
    assert ours["test_loss"] == pytest.approx(reference["test_loss"], abs=1e-6)
    # steps 2, 4, 6, evaluate()'s row, its result (and step 0 with eval_on_start)
    assert len(ours["eval_loss"]) == 5 + bool(knobs) and len(ours["learning_rate"]) == 6
    if knobs:  # lr_scheduler_kwargs took effect: the cosine ends at min_lr, not 0
        assert min(ours["learning_rate"][2:]) >= 1e-3
    assert ours["tokens_seen"] == reference["tokens_seen"] == 6 * 8 * 16  # include_num_input_tokens_seen


def test_token_level_loss_is_exact_under_accumulation(tmp_path):
    """4 micro-batches of 4 variable-length sequences = one batch of 16: the window's tokens are counted."""
    knobs = {"optim": "sgd", "learning_rate": 0.5, "max_steps": 3, "do_eval": False, "gradient_checkpointing": False}
    one = run_script("impel.trainer.hf", str(tmp_path / "one"), per_device_train_batch_size=16, **knobs)
    acc = run_script("impel.trainer.hf", str(tmp_path / "acc"), per_device_train_batch_size=4,
                     gradient_accumulation_steps=4, **knobs)
    assert _max_diff(acc["weights"], one["weights"]) <= 1e-6
    assert acc["loss"] == pytest.approx(one["loss"], abs=1e-6)


def test_the_deepspeed_knob_becomes_impels_plugin_with_transformers_filled_json(tmp_path):
    """transformers fills the JSON's "auto" values from the arguments; impel's engine gets them with
    accumulation 1 (transformers accumulates and marks each boundary) and its own train_batch_size."""
    from transformers import TrainingArguments

    from impel.config.plugins import DeepSpeedPlugin
    from impel.trainer.hf import accelerator_arguments

    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], deepspeed=ds,
                             per_device_train_batch_size=4, gradient_accumulation_steps=3, learning_rate=0.25,
                             weight_decay=0.5, max_grad_norm=0.75)
    plugin = accelerator_arguments(args, tiny_gpt2())["deepspeed_plugin"]
    assert isinstance(plugin, DeepSpeedPlugin)
    json = plugin.hf_ds_config
    assert (json["train_micro_batch_size_per_gpu"], json["gradient_accumulation_steps"]) == (4, 1)
    assert "train_batch_size" not in json and json["gradient_clipping"] == 0.75
    assert json["optimizer"]["params"] == {"lr": 0.25, "weight_decay": 0.5}
    assert args.hf_deepspeed_config.config["gradient_accumulation_steps"] == 3  # transformers' copy untouched
    assert accelerator_arguments(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                                 tiny_gpt2())["deepspeed_plugin"] is None


def test_a_deepspeed_launch_without_the_knob_raises_naming_it(tmp_path, monkeypatch):
    """ACCELERATE_USE_DEEPSPEED (a DeepSpeed launch) makes transformers build Accelerate's plugin from the
    environment; impel takes DeepSpeed from the deepspeed= knob only."""
    from transformers import TrainingArguments

    from impel.trainer.hf import Trainer

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert args.deepspeed_plugin is not None and not args.deepspeed
    with pytest.raises(ConfigError, match=r"launched with DeepSpeed.*TrainingArguments\(deepspeed='ds.json'"):
        Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(8))


@pytest.mark.parametrize("sizes, words", [({"tp_size": 2}, "tp_size=2"), ({"cp_size": 2}, "cp_size=2")])
def test_parallelism_config_sizes_this_route_does_not_serve_raise(tmp_path, sizes, words):
    from impel import ParallelismConfig
    from impel.trainer.hf import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.parallelism_config = ParallelismConfig(**sizes)
    with pytest.raises(ConfigError, match=rf"parallelism_config=ParallelismConfig\({words}\).*custom loop"):
        Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(8))


def test_parallelism_config_data_parallel_sizes_reach_impels_accelerator(tmp_path):
    from accelerate import ParallelismConfig as AccelerateParallelismConfig

    from impel import ParallelismConfig
    from impel.trainer.hf import TrainingArguments, accelerator_arguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             parallelism_config=AccelerateParallelismConfig(dp_replicate_size=2, dp_shard_size=3))
    ours = accelerator_arguments(args, tiny_gpt2())["parallelism_config"]
    assert isinstance(ours, ParallelismConfig)
    assert (ours.dp_replicate_size, ours.dp_shard_size, ours.tp_size, ours.cp_size) == (2, 3, 1, 1)


def test_public_members_work_on_impel(tmp_path):
    from transformers import TrainingArguments

    from impel.trainer.hf import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
                             max_steps=2, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(8),
                      eval_dataset=padded_lm_data(4, seed=1))
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    loader = trainer.get_test_dataloader(padded_lm_data(4, seed=2))
    assert trainer.num_examples(loader) == 4
    batch = next(iter(loader))
    assert trainer.floating_point_ops(batch) > 0
    loss, logits, labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
    assert torch.isfinite(loss) and logits.shape[:2] == labels.shape
    result = trainer.train()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_model()
    assert {"train_results.json", "all_results.json", "trainer_state.json", "model.safetensors"} <= \
        set(os.listdir(tmp_path))
    assert trainer.predict(padded_lm_data(4, seed=2)).metrics["test_loss"] > 0


def test_docs_table_is_generated_from_the_code():
    from impel.trainer.hf_fields import NOTES, field_names, fields_table, members_line

    assert set(NOTES) <= set(field_names()) and len(field_names()) >= 100
    block = (f"{START}\n{fields_table()}\n\nEvery public `Trainer` member is transformers' own code (impel's replaces "
             "`create_accelerator_and_postprocess`, and wraps `train` for `resume_from_checkpoint=\"auto\"`): "
             f"{members_line()}.\n{END}")
    path = DOCS / "trainer.md"
    text = path.read_text(encoding="utf-8")
    if os.environ.get("IMPEL_UPDATE_DOCS") == "1":
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        path.write_text(text, encoding="utf-8")
    assert block in text, "docs/trainer.md's field table is stale: run IMPEL_UPDATE_DOCS=1 pytest " + __file__


def test_a_mid_epoch_resume_ends_with_the_uninterrupted_weights(tmp_path):
    """transformers' resume skips the epoch's first batches with impel's skip_first_batches on impel's loader."""
    from impel.trainer.hf import Trainer, TrainingArguments

    def trainer(out):
        args = TrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, max_steps=6, learning_rate=5e-3, use_cpu=True,
                                 report_to=[], disable_tqdm=True, save_strategy="steps", save_steps=3, seed=3,
                                 logging_steps=1)
        return Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data())

    full = trainer("full")
    full.train()
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))  # step 3 of 8: mid-epoch
    assert _max_diff(resumed.model.state_dict(), full.model.state_dict()) == 0.0
    losses = [[row["loss"] for row in t.state.log_history if "loss" in row] for t in (full, resumed)]
    assert losses[0] == losses[1]


def test_the_accelerator_arguments_carry_the_fields(tmp_path):
    """The fields transformers hands its Accelerator reach impel's (built by impel.trainer.hf.accelerator_arguments)."""
    from transformers import TrainingArguments

    from impel.trainer.hf import accelerator_arguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], torch_compile=True,
                             torch_compile_mode="reduce-overhead", ddp_find_unused_parameters=False,
                             ddp_bucket_cap_mb=7, ddp_static_graph=True, gradient_accumulation_steps=3, data_seed=11,
                             accelerator_config={"even_batches": False, "use_seedable_sampler": False,
                                                 "gradient_accumulation_kwargs": {"sync_each_batch": True}})
    kwargs = accelerator_arguments(args, tiny_gpt2())
    dynamo = kwargs["dynamo_plugin"]
    assert (str(dynamo.backend).lower().endswith("inductor"), dynamo.mode) == (True, "reduce-overhead")
    ddp = kwargs["kwargs_handlers"][0]
    assert (ddp.find_unused_parameters, ddp.bucket_cap_mb, ddp.static_graph) == (False, 7, True)
    loader = kwargs["dataloader_config"]
    assert (loader.even_batches, loader.use_seedable_sampler, loader.data_seed) == (False, False, None)
    plugin = kwargs["gradient_accumulation_plugin"]
    assert (plugin.num_steps, plugin.sync_each_batch) == (1, True)  # transformers accumulates (3) itself
    assert kwargs["cpu"] is True and kwargs["fsdp_plugin"] is None and kwargs["mixed_precision"] == "no"
    gpt2 = tiny_gpt2()
    gpt2.gradient_checkpointing_enable()  # transformers' rule: a checkpointing model does not look for unused ones
    default = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    seeded = accelerator_arguments(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                                     data_seed=11), gpt2)["dataloader_config"]
    assert (seeded.use_seedable_sampler, seeded.data_seed) == (True, 11)
    assert accelerator_arguments(default, gpt2)["kwargs_handlers"][0].find_unused_parameters is False
    assert accelerator_arguments(default, torch.nn.Linear(2, 2))["kwargs_handlers"][0].find_unused_parameters


def test_the_best_checkpoint_and_rotation_equal_transformers(tmp_path):
    """load_best_model_at_end with save_total_limit=1: the same best step and metric, the same checkpoints kept
    (the newest and the best), the best weights loaded at the end; every kept checkpoint is marked complete."""
    knobs = {"learning_rate": 0.3, "max_steps": 8, "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
             "save_total_limit": 1, "load_best_model_at_end": True, "metric_for_best_model": "eval_loss",
             "do_eval": False}
    reference = run_script("transformers", str(tmp_path / "hf"), **knobs)
    ours = run_script("impel", str(tmp_path / "impel"), **knobs)
    best_metric, best_step, best_dir = ours["best"]
    assert best_dir == f"checkpoint-{best_step}" and best_metric == min(ours["eval_loss"][:4])
    assert best_step < 8  # lr 0.3 overshoots: the best is not the newest, so the rotation has a choice
    assert ours["best"][1:] == reference["best"][1:] and best_metric == pytest.approx(reference["best"][0], abs=1e-6)
    kept = {name.split("/")[0] for name in reference["files"]}
    assert {name.split("/")[0] for name in ours["files"]} == kept and f"checkpoint-{best_step}" in kept
    assert {f"{ckpt}/impel_complete.json" for ckpt in kept} <= set(ours["files"])
    assert _max_diff(ours["weights"], reference["weights"]) <= 1e-5


def test_import_impel_does_not_import_transformers_and_names_the_extra_without_it():
    """``impel.Trainer`` is resolved on first use; without transformers it raises naming the extra."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import impel\n"
            "assert 'transformers' not in sys.modules, 'import impel imported transformers'\n"
            "sys.modules['transformers'] = None  # as if not installed\n"
            "try:\n"
            "    impel.Trainer\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "pip install 'impel[transformers]'" in out.stdout and "impel.Trainer" in out.stdout, out.stderr
    import impel
    import impel.trainer.hf as hf

    assert impel.Trainer is hf.Trainer and issubclass(impel.Trainer, __import__("transformers").Trainer)
    from transformers import TrainerCallback, TrainerState, TrainingArguments

    assert (impel.TrainingArguments, impel.TrainerCallback, impel.TrainerState) == \
        (TrainingArguments, TrainerCallback, TrainerState)


def test_accumulation_set_twice_raises_naming_both(tmp_path):
    from impel import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_accumulation_steps=2,
                             accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 4}})
    with pytest.raises(ConfigError, match=r"num_steps=4 and gradient_accumulation_steps=2: set one of them"):
        Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(8))


def test_the_launch_configs_auto_resume_names_the_trainers_switch(tmp_path, monkeypatch):
    """impel launch --auto_resume is the Accelerator's (save_state checkpoints); the Trainer's is "auto"."""
    import json

    from impel import Trainer, TrainingArguments
    from impel.config import environment as env

    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"auto_resume": True}))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match=r"auto_resume=true in the launch config.*resume_from_checkpoint=\"auto\""):
        Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(8))


def test_an_fsdp_config_key_transformers_drops_under_fsdp2_raises(tmp_path):
    """transformers builds FSDP2's plugin from some fsdp_config keys and drops the rest without a word (FSDP1's
    forward_prefetch, a typo): on impel each one takes effect or raises, naming the key."""
    from transformers import TrainingArguments

    from impel.trainer.hf import accelerator_arguments

    good = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True,
                             fsdp_config={"fsdp_state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": False})
    plugin = accelerator_arguments(good, tiny_gpt2())["fsdp_plugin"]
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type) and plugin.reshard_after_forward is False
    dropped = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True,
                                fsdp_config={"forward_prefetch": True, "fsdp_sync_module_state": True})
    with pytest.raises(ConfigError, match=r"fsdp_config keys \['forward_prefetch', 'sync_module_state'\] have no "
                                          r"effect under FSDP2 .* remove them"):
        accelerator_arguments(dropped, tiny_gpt2())
