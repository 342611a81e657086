"""DeepSpeed ZeRO on 2 CPU ranks trains exactly like DDP: stages 0-3, 4-step accumulation, clipping, bf16,
CPU and NVMe offload, ZeRO-3 partitioning at construction, and a JSON whose values are all "auto".

DeepSpeed's import and first engine cost seconds, so one ``run_on_ranks`` job runs every configuration in sequence
(each its own Accelerator and engine) and the tests below check its results. References: the same loop under DDP
in the same job (DDP itself equals a single process to 1e-6, see test_ddp_equivalence.py).

Tolerances: fp32 ZeRO vs DDP 1e-5 (both average the same fp32 gradients; they differ only in reduction order, seen
below 2e-7); offloaded vs not 1e-6 (the same arithmetic on CPU); bf16 loss within 5% (+0.02) of fp32 per step
(bf16 keeps 8 bits of mantissa: ~0.4% per rounding, a few roundings per layer over 10 steps).

NVMe offload needs DeepSpeed's async I/O op, a C++ extension built against libaio that takes minutes to compile:
it is trained only where the op is already built (``make deepspeed-ops`` installs libaio-dev and builds it);
everywhere, a missing op must give an error that says what to install.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_optimizer, make_regression, max_abs_diff
from impel.testing import run_on_ranks

JOB_TIMEOUT = 400
# the module fixture's job plus the test's own work: pytest-timeout sits above, so a hang is reported by
# run_on_ranks (with the ranks' stacks)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(JOB_TIMEOUT + 120)]

STEPS = 10
FP32_TOL = 1e-5
OFFLOAD_TOL = 1e-6
AUTO_JSON = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": "auto"},
    # torch_adam: torch's AdamW, not DeepSpeed's FusedAdam, a C++ op compiled on first use (minutes on 2 cores)
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto",
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
}


def _full_params(acc, model) -> dict[str, torch.Tensor]:
    """The module's parameters, gathered under ZeRO-3."""
    module = acc.unwrap_model(model)
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().clone().float() for k, v in module.state_dict().items()}
    return {k: v.detach().clone().float() for k, v in module.state_dict().items()}


def _masters(acc, model) -> dict[str, torch.Tensor]:
    """DeepSpeed's float32 master weights (what the optimizer updates), gathered."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = acc.unwrap_model(model)
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in module.named_parameters()}


def _train(plugin=None, *, accumulation=1, optimizer="sgd", clip=None, mixed_precision=None, dtype=None,
           init=False, scheduler=None):
    """One run: a fresh Accelerator (DeepSpeed when ``plugin`` is given, else DDP) over the same data."""
    from impel import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation if plugin is None else None,
                      mixed_precision=mixed_precision, deepspeed_plugin=plugin)
    with acc.init_context() if init else _nothing():
        model = make_mlp()
    if dtype is not None:
        model.to(dtype)
    opt = optimizer(model) if callable(optimizer) else make_optimizer(model, optimizer,
                                                                        0.05 if optimizer == "sgd" else 1e-2)
    sched = scheduler(opt) if scheduler else None
    loader = DataLoader(make_regression(), batch_size=4 // accumulation, shuffle=False)
    objects = acc.prepare(model, opt, loader, *([sched] if sched else []))
    model, opt, loader = objects[:3]
    sched = objects[3] if sched else None
    losses, norms, lrs = [], [], []
    for micro, (x, y) in enumerate(loader):
        if micro == STEPS * accumulation:
            break
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(x).float(), y)  # float32 inputs: autocast meets 16-bit weights
            acc.backward(loss)
            if clip is not None and acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
        if sched is not None and acc.sync_gradients:
            lrs.append(sched.get_last_lr()[0])
    return acc, model, {"losses": losses, "norms": [float(n) for n in norms], "lrs": lrs}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def async_io_built() -> bool:
    """DeepSpeed's async_io extension is compiled and cached (loading it then takes a second, not minutes)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory("async_io", verbose=False)) / "async_io.so").is_file()
    except Exception:  # noqa: BLE001 - any failure means "not available here"
        return False


def _nvme_runs(out: dict, nvme_dir: str | None) -> None:
    from deepspeed.ops.op_builder.cpu.async_io import AsyncIOBuilder

    from impel import Accelerator, DeepSpeedPlugin
    from impel.config.run_config import ConfigError

    if nvme_dir is not None:
        # DeepSpeed's default swap buffers are 5 x 1e8 elements per rank; this model's largest tensor has 96
        small = {"zero_optimization": {"offload_param": {"buffer_size": 1024, "buffer_count": 4}}}
        acc, model, _ = _train(DeepSpeedPlugin(
            hf_ds_config=small, zero_stage=3, gradient_accumulation_steps=4, offload_optimizer_device="nvme",
            offload_optimizer_nvme_path=nvme_dir, offload_param_device="nvme", offload_param_nvme_path=nvme_dir),
            accumulation=4, optimizer="adamw")
        out["nvme"] = _full_params(acc, model)
    compatible = AsyncIOBuilder.is_compatible
    AsyncIOBuilder.is_compatible = lambda self, verbose=False: False  # a machine without libaio
    try:
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, offload_param_device="nvme",
                                                               offload_param_nvme_path="/nonexistent"))
        out["nvme_missing"] = None
    except ConfigError as exc:
        out["nvme_missing"] = str(exc)
    finally:
        AsyncIOBuilder.is_compatible = compatible


def _all_runs(nvme_dir: str | None) -> dict:
    from impel import DeepSpeedPlugin, DummyOptim, DummyScheduler
    from impel.config.run_config import ConfigError

    out: dict = {"stages": {}, "accumulated": {}}
    acc, model, _ = _train()
    out["ddp"] = _full_params(acc, model)
    acc, model, _ = _train(accumulation=4, optimizer="adamw")
    out["ddp_accumulated"] = _full_params(acc, model)
    acc, model, ddp_clip = _train(clip=0.5)
    out["ddp_clip"] = (_full_params(acc, model), ddp_clip["norms"])
    for stage in (0, 1, 2, 3):
        acc, model, run = _train(DeepSpeedPlugin(zero_stage=stage))
        out["stages"][stage] = (_full_params(acc, model), run["losses"])
    for stage in (1, 2, 3):
        acc, model, _ = _train(DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=4), accumulation=4,
                               optimizer="adamw")
        out["accumulated"][stage] = _full_params(acc, model)
    acc, model, _ = _train(DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=4,
                                           offload_optimizer_device="cpu"), accumulation=4, optimizer="adamw")
    out["offload_2"] = _full_params(acc, model)
    acc, model, _ = _train(DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=4, offload_optimizer_device="cpu",
                                           offload_param_device="cpu"), accumulation=4, optimizer="adamw")
    out["offload_3"] = _full_params(acc, model)
    acc, model, run = _train(DeepSpeedPlugin(zero_stage=2), clip=0.5)
    out["clip"] = (_full_params(acc, model), run["norms"])
    acc, model, run = _train(DeepSpeedPlugin(zero_stage=1, gradient_clipping=0.5), clip=0.5)
    out["clip_configured"] = _full_params(acc, model)
    try:
        acc.clip_grad_norm_(model.parameters(), 0.3)
        out["contradiction"] = None
    except ConfigError as exc:
        out["contradiction"] = str(exc)
    acc, model, _ = _train(DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True), init=True)
    out["zero3_init"] = _full_params(acc, model)
    acc, model, run = _train(DeepSpeedPlugin(zero_stage=2), mixed_precision="bf16", dtype=torch.bfloat16)
    out["bf16"] = (run["losses"], acc.precision_report().as_dict(), _masters(acc, model))
    acc, model, _ = _train(DeepSpeedPlugin(zero_stage=1), dtype=torch.bfloat16)
    out["bf16_loaded_fp32_run"] = acc.precision_report().as_dict()
    acc, model, run = _train(
        DeepSpeedPlugin(hf_ds_config=AUTO_JSON, zero_stage=2, gradient_accumulation_steps=2), accumulation=2,
        optimizer=lambda m: DummyOptim(m.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8),
        scheduler=lambda o: DummyScheduler(o, warmup_num_steps=4))
    out["auto"] = ({k: model.config[k] for k in ("train_micro_batch_size_per_gpu", "train_batch_size",
                                                 "gradient_accumulation_steps", "gradient_clipping", "bf16",
                                                 "zero_optimization", "optimizer", "scheduler")}, run)
    _nvme_runs(out, nvme_dir)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("nvme")) if async_io_built() else None
    return run_on_ranks(_all_runs, 2, args=(nvme_dir,), timeout=JOB_TIMEOUT)


def test_every_zero_stage_matches_ddp_in_fp32(runs):
    for rank in runs:
        for stage, (params, _) in rank["stages"].items():
            assert max_abs_diff(params, rank["ddp"]) <= FP32_TOL, f"ZeRO stage {stage}"
    assert max_abs_diff(runs[0]["stages"][3][0], runs[1]["stages"][3][0]) == 0.0


def test_zero_with_four_step_accumulation_matches_ddp(runs):
    for rank in runs:
        for stage, params in rank["accumulated"].items():
            assert max_abs_diff(params, rank["ddp_accumulated"]) <= FP32_TOL, f"ZeRO stage {stage}"


def test_zero3_partitions_a_model_built_in_the_init_context_and_trains_the_same(runs):
    for rank in runs:
        assert max_abs_diff(rank["zero3_init"], rank["ddp"]) <= FP32_TOL


def test_cpu_offload_matches_the_run_without(runs):
    for rank in runs:
        assert max_abs_diff(rank["offload_2"], rank["accumulated"][2]) <= OFFLOAD_TOL
        assert max_abs_diff(rank["offload_3"], rank["accumulated"][3]) <= OFFLOAD_TOL


@pytest.mark.skipif(not async_io_built(), reason="DeepSpeed's async_io op is not built (make deepspeed-ops, as root)")
def test_nvme_offload_matches_the_run_in_memory(runs):
    for rank in runs:
        assert max_abs_diff(rank["nvme"], rank["accumulated"][3]) <= OFFLOAD_TOL


def test_without_async_io_nvme_offload_says_what_is_missing(runs):
    message = runs[0]["nvme_missing"]
    assert message is not None and "offload_param_device='nvme' needs DeepSpeed's async I/O op" in message
    assert "libaio" in message and "apt-get install libaio-dev" in message


def test_clip_grad_norm_honours_max_norm_and_returns_ddp_s_norm(runs):
    for rank in runs:
        ddp_params, ddp_norms = rank["ddp_clip"]
        params, norms = rank["clip"]
        assert max_abs_diff(params, ddp_params) <= FP32_TOL
        assert max(abs(a - b) for a, b in zip(norms, ddp_norms)) <= FP32_TOL
        assert max(ddp_norms) > 0.5  # the clip really cut some steps
        assert max_abs_diff(rank["clip_configured"], ddp_params) <= FP32_TOL


def test_a_max_norm_contradicting_gradient_clipping_raises(runs):
    message = runs[0]["contradiction"]
    assert message is not None and "max_norm=0.3" in message and "gradient_clipping=0.5" in message


def test_bf16_trains_near_the_fp32_run_with_fp32_master_weights(runs):
    for rank in runs:
        losses, report, masters = rank["bf16"]
        fp32_losses = rank["stages"][2][1]
        for got, want in zip(losses, fp32_losses):
            assert abs(got - want) <= 0.05 * want + 0.02
        assert losses[-1] < losses[0]
        assert (report["stored_params"], report["compute"], report["optimizer_states"]) == (
            torch.float32, torch.bfloat16, torch.float32)
        assert "loaded as bfloat16" in report["note"] and "module working copy bfloat16" in report["note"]
        assert all(t.dtype == torch.float32 for t in masters.values())
        # the bf16 run's fp32 masters stay close to the fp32 run's weights
        assert max_abs_diff(masters, {k: v for k, v in rank["stages"][2][0].items()}) <= 0.05


def test_a_bf16_loaded_model_without_mixed_precision_is_upcast_to_fp32(runs):
    report = runs[0]["bf16_loaded_fp32_run"]
    assert (report["stored_params"], report["compute"], report["optimizer_states"]) == (torch.float32,) * 3
    assert "loaded as bfloat16, upcast to float32 at prepare" in report["note"]


def test_a_json_of_auto_values_is_filled_from_the_accelerator(runs):
    config, run = runs[0]["auto"]
    assert config["train_micro_batch_size_per_gpu"] == 2  # the prepared DataLoader's batch size per rank
    assert config["train_batch_size"] == 2 * 2 * 2  # micro batch x accumulation x ranks
    assert config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 0.0 and config["bf16"] == {"enabled": False}
    assert config["zero_optimization"]["stage"] == 2
    assert config["optimizer"]["params"] == {"lr": 1e-2, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8,
                                             "torch_adam": True}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}
    # the JSON's WarmupLR steps once per optimizer step: it reaches its peak after warmup_num_steps of them
    assert len(run["lrs"]) == STEPS and run["lrs"][:3] != [1e-2] * 3 and run["lrs"][4:] == [1e-2] * (STEPS - 4)
    assert run["losses"][-1] < run["losses"][0]
