"""DeepSpeed saving on 2 CPU ranks: ZeRO-3 16-bit ``save_model``, engine checkpoints through ``save_state`` /
``load_state`` (exact resume), their consolidation to float32 safetensors, and loading without pickled code.

One ``run_on_ranks`` job (DeepSpeed's import costs seconds) runs a bf16 ZeRO-3 model built in the init context and
an fp32 ZeRO-2 model; the parent process then merges both checkpoints like ``impel merge-weights`` does. Every
comparison is exact (0.0): the same tensors are written and read back, the same arithmetic is replayed. Last (its
zero.Init patches torch for the rest of the process), transformers' ``from_pretrained`` after the Accelerator loads
straight into ZeRO-3 partitions.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression, max_abs_diff
from impel.testing import run_on_ranks

JOB_TIMEOUT = 300
# the module fixture's job plus the test's own work: pytest-timeout sits above, so a hang is reported by
# run_on_ranks (with the ranks' stacks)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(JOB_TIMEOUT + 120)]


class NotAllowed:
    """Any class outside torch's and DeepSpeed's allowlist: loading it must fail, not run its code."""


def _gathered(acc, model) -> dict[str, torch.Tensor]:
    import deepspeed

    module = acc.unwrap_model(model)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=hasattr(module[0].weight, "ds_id")):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _masters(acc, model) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}


def _steps(acc, model, opt, batches) -> None:
    for x, y in batches:
        acc.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()


def _zero3_bf16(tmp: Path) -> dict:
    from impel import Accelerator, DeepSpeedPlugin

    acc = Accelerator(cpu=True, mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(
        zero_stage=3, zero3_init_flag=True, zero3_save_16bit_model=True))
    with acc.init_context():
        model = make_mlp()
    out: dict = {"partitioned": all(p.numel() == 0 and hasattr(p, "ds_id") for p in model.parameters())}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(), batch_size=4))
    batches = list(loader)
    _steps(acc, model, opt, batches[:3])
    acc.save_model(model, tmp / "export")
    out["gathered"] = _gathered(acc, model)
    out["masters"] = _masters(acc, model)
    acc.save_state(tmp / "ckpt3")
    _steps(acc, model, opt, batches[3:5])
    first = (_gathered(acc, model), _masters(acc, model))
    acc.load_state(tmp / "ckpt3")
    out["restored"] = (_gathered(acc, model), _masters(acc, model))
    _steps(acc, model, opt, batches[3:5])
    out["replayed"] = (_gathered(acc, model), _masters(acc, model))
    out["first"] = first
    return out


def _zero2_fp32(tmp: Path) -> dict:
    from impel import Accelerator, DeepSpeedPlugin

    acc = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(), batch_size=4))
    _steps(acc, model, opt, list(loader)[:3])
    acc.save_state(tmp / "ckpt2")
    return {"params": _gathered(acc, model)}


def _unsafe_load(tmp: Path) -> str:
    from impel.strategies.deepspeed import safe_loading

    path = tmp / "unsafe.pt"
    torch.save({"payload": NotAllowed()}, path)
    try:
        with safe_loading():
            torch.load(path, weights_only=False)  # what DeepSpeed's readers ask for
    except pickle.UnpicklingError as exc:
        return str(exc)
    return "loaded"


def _from_pretrained(tmp: Path) -> dict:
    """The documented order: Accelerator (ZeRO-3, zero3_init_flag) first, then ``from_pretrained``."""
    import deepspeed
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from impel import Accelerator, DeepSpeedPlugin

    torch.manual_seed(0)
    reference = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                           bos_token_id=0, eos_token_id=0))
    if dist.get_rank() == 0:
        reference.save_pretrained(tmp / "gpt2")
    dist.barrier()
    acc = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True))
    model = GPT2LMHeadModel.from_pretrained(tmp / "gpt2")
    partitioned = all(p.numel() == 0 and hasattr(p, "ds_id") for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    acc.end_training()
    expected = reference.state_dict()
    return {"partitioned": partitioned, "diff": max_abs_diff(loaded, {k: expected[k] for k in loaded}),
            "missing": sorted(set(expected) - set(loaded))}


def _all_runs(tmp: str) -> dict:
    import torch.distributed as dist

    root = Path(tmp)
    out = {"zero3": _zero3_bf16(root), "zero2": _zero2_fp32(root)}
    if dist.get_rank() == 0:
        out["unsafe"] = _unsafe_load(root)
    out["hf"] = _from_pretrained(root)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed")
    return tmp, run_on_ranks(_all_runs, 2, args=(str(tmp),), timeout=JOB_TIMEOUT)


def test_zero3_init_context_partitions_the_model_at_construction(saved):
    _, ranks = saved
    assert all(r["zero3"]["partitioned"] for r in ranks)


def test_zero3_16bit_save_model_writes_the_gathered_weights(saved):
    from safetensors.torch import load_file

    tmp, ranks = saved
    written = load_file(tmp / "export" / "model.safetensors")
    gathered = ranks[0]["zero3"]["gathered"]
    assert written.keys() == gathered.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, gathered[name])


def test_load_state_restores_the_engine_and_the_run_resumes_exactly(saved):
    _, ranks = saved
    for rank in ranks:
        run = rank["zero3"]
        assert max_abs_diff(run["restored"][0], run["gathered"]) == 0.0
        assert max_abs_diff(run["restored"][1], run["masters"]) == 0.0
        assert max_abs_diff(run["replayed"][0], run["first"][0]) == 0.0  # bf16 working copy
        assert max_abs_diff(run["replayed"][1], run["first"][1]) == 0.0  # fp32 masters and optimizer states
        assert max_abs_diff(run["first"][1], run["masters"]) > 0  # the two extra steps did change the weights


def test_the_checkpoint_records_its_deepspeed_format(saved):
    tmp, _ = saved
    meta = json.loads((tmp / "ckpt3" / "impel_checkpoint.json").read_text())
    assert meta["strategy"]["format"] == "deepspeed" and meta["strategy"]["zero_stage"] == 3
    assert (tmp / "ckpt3" / "deepspeed" / "zero").is_dir()


@pytest.mark.parametrize("name, key", [("ckpt3", "zero3"), ("ckpt2", "zero2")])
def test_merge_weights_consolidates_zero_shards_into_fp32_safetensors(saved, name, key):
    from safetensors.torch import load_file

    from impel import merge_weights

    tmp, ranks = saved
    files = merge_weights(tmp / name, tmp / f"merged_{key}")
    merged = load_file(files[0])
    expected = ranks[0][key]["masters"] if key == "zero3" else ranks[0][key]["params"]
    assert merged.keys() == expected.keys()
    for tensor in merged.values():
        assert tensor.dtype == torch.float32
    assert max_abs_diff(merged, expected) == 0.0


def test_deepspeed_s_checkpoint_readers_cannot_run_pickled_code(saved):
    _, ranks = saved
    assert "NotAllowed" in ranks[0]["unsafe"]


def test_from_pretrained_after_the_accelerator_loads_into_zero3_partitions(saved):
    _, ranks = saved
    for rank in ranks:
        assert rank["hf"]["partitioned"] and rank["hf"]["missing"] == []
        assert rank["hf"]["diff"] == 0.0
