"""TRL 1.16's trainers on impel through the documented route (``impel.trainer.on_impel``), one process: the same
weights, losses and rewards as TRL on Accelerate; Accelerate's own state mirrored for TRL's helpers
(``impel.accelerator.accelerate_state``); the FSDP plugin holding torch's policies TRL shards with."""
from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from impel import Accelerator  # noqa: E402
from trl_helpers import KINDS, max_diff, run_trl  # noqa: E402


def test_on_impel_puts_impels_trainer_first_once_per_class():
    import transformers
    import trl

    from impel.trainer import Trainer, on_impel

    routed = on_impel(trl.SFTTrainer)
    assert routed is on_impel(trl.SFTTrainer) and routed.__name__ == "SFTTrainer"
    assert routed.__mro__[1:3] == (Trainer, trl.SFTTrainer) and issubclass(routed, transformers.Trainer)
    assert on_impel(Trainer) is Trainer and on_impel(routed) is routed
    with pytest.raises(TypeError, match="expected a transformers.Trainer subclass"):
        on_impel(Accelerator)


def test_trl_trainers_on_impel_equal_trl_on_accelerate_and_resume_from_a_mid_run_checkpoint(tmp_path):
    """SFT (plain and LoRA), DPO (and sync_ref_model, which calls Accelerate's helpers), Reward, GRPO: accumulation 2,
    4 optimizer steps, a checkpoint every 2; each run resumed from checkpoint-2 ends on the uninterrupted run."""
    for kind in KINDS:
        theirs = run_trl(kind, "accelerate", str(tmp_path / kind / "accelerate"))
        ours = run_trl(kind, "impel", str(tmp_path / kind / "impel"), save_strategy="steps", save_steps=2)
        resumed = run_trl(kind, "impel", str(tmp_path / kind / "resumed"),
                          resume=str(tmp_path / kind / "impel" / "checkpoint-2"))
        assert (theirs["accelerator"], ours["accelerator"]) == ("accelerate.accelerator", "impel.accelerator.facade")
        assert max_diff(ours["weights"], theirs["weights"]) <= 1e-6, kind
        assert len(ours["loss"]) == 4 and ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6), kind
        assert ours["reward"] == pytest.approx(theirs["reward"], abs=1e-6), kind
        assert ours["checkpoints"] == ["checkpoint-2", "checkpoint-4"] and resumed["step"] == 4, kind
        assert max_diff(resumed["weights"], ours["weights"]) == 0.0, kind
        assert (resumed["loss"], resumed["reward"]) == (ours["loss"], ours["reward"]), kind


def test_a_synced_reference_model_resumes_as_synced_and_an_accelerate_checkpoint_as_on_accelerate(tmp_path, caplog):
    """DPO with sync_ref_model: the checkpoint holds the reference model as synced at step 2 (impel_ref_model.pt),
    which transformers' does not (TRL on Accelerate resumes from the reference model as loaded)."""
    from impel.trainer import hf_ref_model

    ours = run_trl("dpo_sync", "impel", str(tmp_path / "impel"), save_strategy="steps", save_steps=2)
    assert os.path.isfile(tmp_path / "impel" / "checkpoint-2" / hf_ref_model.FILE)
    theirs = run_trl("dpo_sync", "accelerate", str(tmp_path / "accelerate"), save_strategy="steps", save_steps=2)
    assert not os.path.exists(tmp_path / "accelerate" / "checkpoint-2" / hf_ref_model.FILE)
    their_resume = run_trl("dpo_sync", "accelerate", str(tmp_path / "accelerate-resumed"),
                           resume=str(tmp_path / "accelerate" / "checkpoint-2"))
    with caplog.at_level(logging.WARNING, logger="impel"):
        our_resume = run_trl("dpo_sync", "impel", str(tmp_path / "impel-resumed"),
                             resume=str(tmp_path / "accelerate" / "checkpoint-2"))
    assert max_diff(our_resume["weights"], their_resume["weights"]) <= 1e-6
    assert max_diff(our_resume["weights"], ours["weights"]) > 1e-3  # the reference model as loaded, not synced
    warned = [r.message for r in caplog.records if hf_ref_model.FILE in r.message]
    assert len(warned) == 1 and "goes on as loaded, not as synced" in warned[0]
    assert max_diff(ours["weights"], theirs["weights"]) == 0.0  # the extra file changes no number


def test_accelerates_helpers_run_on_the_mirrored_state(caplog):
    import accelerate.utils
    from accelerate.logging import get_logger
    from accelerate.state import AcceleratorState, PartialState

    with caplog.at_level(logging.INFO, logger="impel"):
        acc = Accelerator(cpu=True, mixed_precision="bf16")
    assert [r.message for r in caplog.records if "mirrors this run" in r.message] == [
        "impel: Accelerate's AcceleratorState mirrors this run (process 0 of 1, cpu, NO, mixed precision bf16) for "
        "libraries that call Accelerate's helpers (TRL, PEFT); training runs on impel's Accelerator"]
    state = AcceleratorState()
    assert (state.process_index, state.num_processes, state.mixed_precision, state.distributed_type) == (
        0, 1, "bf16", "NO")
    assert PartialState().device == acc.device
    accelerate.utils.set_seed(3, device_specific=True)  # reads AcceleratorState().process_index
    assert accelerate.utils.gather_object(["a"]) == ["a"] and accelerate.utils.broadcast_object_list([1]) == [1]
    get_logger("trl").info("logs")  # Accelerate's multi-process logger needs its PartialState
    again = Accelerator(cpu=True)  # a later impel Accelerator mirrors its own settings
    assert AcceleratorState().mixed_precision == again.mixed_precision == "no"


def test_accelerates_own_accelerator_built_first_is_left_alone_and_named(caplog):
    import accelerate
    from accelerate.state import AcceleratorState

    theirs = accelerate.Accelerator(cpu=True)
    with caplog.at_level(logging.WARNING, logger="impel"):
        Accelerator(cpu=True, mixed_precision="bf16")
    assert any("accelerate.Accelerator was also built in this process" in r.message for r in caplog.records)
    assert AcceleratorState().mixed_precision == theirs.mixed_precision == "no"


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_fsdp_plugin_holds_the_policies_trl_shards_a_reference_model_with(precision):
    """TRL's prepare_fsdp (DPO's and GRPO's reference models) passes the plugin's fields to fully_shard."""
    import torch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
    from trl.models.utils import prepare_fsdp

    from impel import FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, mixed_precision=precision, fsdp_plugin=FullyShardedDataParallelPlugin())
    plugin = acc.state.fsdp_plugin
    if precision == "no":
        assert plugin.mixed_precision_policy is None
    else:
        assert isinstance(plugin.mixed_precision_policy, MixedPrecisionPolicy)
        assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert type(plugin.cpu_offload) is OffloadPolicy and plugin.reshard_after_forward is True
    reference = prepare_fsdp(torch.nn.Linear(4, 4), acc)
    assert isinstance(reference, FSDPModule)


def test_the_accelerate_version_impel_provides_is_the_one_its_tests_compare_with():
    """Renamed code gating features on the version (TRL: >= 1.11 / 1.12) reads impel.__accelerate_version__."""
    import accelerate
    from packaging.version import Version

    import impel

    assert Version(impel.__accelerate_version__) >= Version("1.12.0") > Version(impel.__version__)
    assert Version(impel.__accelerate_version__).release[:2] == Version(accelerate.__version__).release[:2]
