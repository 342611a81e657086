"""DDP communication hooks (``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)``)
train to the same parameters under impel as under Accelerate 1.15 itself, on 2 CPU ranks over gloo.

Each hook must also change the result against plain all-reduce: a hook impel silently failed to register would
leave impel's parameters equal to the plain run (and unequal to Accelerate's).

Two settings cannot work in every torch build, and there both frameworks fail; impel must then refuse with a
ConfigError naming the setting and the fix instead of Accelerate's failure:
- bf16 hook / wrapper: DDP accepts them only in a CUDA build of torch with NCCL 2.10+ (Accelerate: TypeError at
  prepare() in the CPU wheels);
- batched_power_sgd: torch's batched_powerSGD_hook fails at its first compressed iteration in torch 2.13
  (Accelerate: AssertionError in backward at iteration start_powerSGD_iter).
Where Accelerate trains with them (another torch), the numbers are compared like the other runs.

Accelerate 1.15 looks the hook up by enum member, so it silently ignores a plain string (``comm_hook="fp16"``);
impel honours both (a documented difference). Accelerate's runs therefore get its enum members, impel's the plain
strings, and one extra run shows Accelerate ignoring the string.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import make_mlp, make_regression
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess
accelerate = pytest.importorskip("accelerate")
ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}  # else Accelerate on a CPU box under torchrun trains unsynchronised

TOLERANCE = 1e-6  # max |impel - Accelerate| over every parameter; both call torch's own hooks, so it is ~0
MIN_HOOK_EFFECT = 1e-5  # max |hook - plain all-reduce| must exceed this (10x the tolerance)
STEPS, BATCH = 6, 4
# start_powerSGD_iter=2 or 3: PowerSGD compresses from that DDP iteration on (torch's default waits 1000)
RUNS = {
    "no/sgd": ({}, "sgd"),
    "no/adamw": ({}, "adamw"),
    "fp16/sgd": ({"comm_hook": "fp16"}, "sgd"),
    "fp16/adamw": ({"comm_hook": "fp16"}, "adamw"),
    "bf16/adamw": ({"comm_hook": "bf16"}, "adamw"),
    "power_sgd/sgd": ({"comm_hook": "power_sgd",
                       "comm_state_option": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}}, "sgd"),
    "power_sgd+fp16/adamw": ({"comm_hook": "power_sgd", "comm_wrapper": "fp16",
                              "comm_state_option": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3,
                                                    "random_seed": 7}}, "adamw"),
    "power_sgd+bf16/sgd": ({"comm_hook": "power_sgd", "comm_wrapper": "bf16",
                            "comm_state_option": {"start_powerSGD_iter": 2}}, "sgd"),
    "batched_power_sgd+fp16/adamw": ({"comm_hook": "batched_power_sgd", "comm_wrapper": "fp16",
                                      "comm_state_option": {"start_powerSGD_iter": 2}}, "adamw"),
    "fp16-as-str/sgd": ({"comm_hook": "fp16"}, "sgd"),  # Accelerate gets the string too
}
ACCELERATE_IGNORES = "fp16-as-str/sgd"


def _train_all(framework: str) -> dict[str, dict]:
    """Every run of RUNS on this rank, each with a fresh Accelerator and model; the batches are sliced by hand so
    that only the hook differs between the frameworks (not their dataloader sharding). A run that raises records
    its error (both ranks fail alike: the hooks are collective)."""
    if framework == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    else:
        from impel import Accelerator, DistributedDataParallelKwargs
    data = make_regression(STEPS * BATCH * 2, dim=6, seed=3)
    out = {}
    for name, (hook_kwargs, optim) in RUNS.items():
        if framework == "accelerate" and name != ACCELERATE_IGNORES:
            hook_kwargs = {k: DDPCommunicationHookType(v) if k in ("comm_hook", "comm_wrapper") else v
                           for k, v in hook_kwargs.items()}
        where = "construction"
        try:
            acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(**hook_kwargs)])
            model = make_mlp(dim=6, hidden=16)
            opt = (torch.optim.SGD(model.parameters(), lr=0.2) if optim == "sgd"
                   else torch.optim.AdamW(model.parameters(), lr=0.05))
            where = "prepare"
            model, opt = acc.prepare(model, opt)
            assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
            for step in range(STEPS):
                where = f"step {step}"
                start = (step * acc.num_processes + acc.process_index) * BATCH
                x, y = data.tensors[0][start:start + BATCH], data.tensors[1][start:start + BATCH]
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
        except (TypeError, ValueError, AssertionError) as exc:  # impel's ConfigError is a ValueError
            out[name] = {"error": f"{type(exc).__name__} at {where}: {exc}"}
            continue
        params = torch.cat([p.detach().flatten() for p in acc.unwrap_model(model).parameters()])
        report = acc.precision_report().reduction if framework == "impel" else None
        out[name] = {"params": params, "reduction": report}
    return out


@pytest.fixture(scope="module")
def trained() -> dict[str, list[dict]]:
    return {"impel": run_on_ranks(_train_all, 2, args=("impel",), timeout=240),
            "accelerate": run_on_ranks(_train_all, 2, args=("accelerate",), env=ACCELERATE_ENV, timeout=240)}


def _check_refusal(run: str, mine: str, theirs: str) -> None:
    """Accelerate failed with a known torch limitation; impel must refuse earlier, naming the setting and a fix."""
    assert mine.startswith("ConfigError"), f"{run}: Accelerate failed ({theirs}) but impel gave {mine!r}"
    if run.startswith("batched_power_sgd"):
        assert theirs.startswith("AssertionError at step"), theirs  # torch's batched_powerSGD_hook
        assert "comm_hook='batched_power_sgd'" in mine and "use comm_hook='power_sgd'" in mine, mine
    else:
        assert theirs.startswith("TypeError at prepare") and "BF16" in theirs, theirs  # DDP refuses bf16 hooks
        field = "comm_hook" if run.startswith("bf16") else "comm_wrapper"
        assert f"{field}='bf16'" in mine and f"use {field}='fp16'" in mine, mine


@pytest.mark.parametrize("run", [r for r in RUNS if r != ACCELERATE_IGNORES])
def test_hook_trains_like_accelerate(trained, run):
    optim = RUNS[run][1]
    for rank in range(2):
        mine, theirs = trained["impel"][rank][run], trained["accelerate"][rank][run]
        if "error" in theirs:
            print(f"{run} rank {rank}: Accelerate failed ({theirs['error'][:90]}...); impel refused: "
                  f"{mine.get('error', '')[:160]}...")
            _check_refusal(run, mine.get("error", "trained"), theirs["error"])
            continue
        assert "error" not in mine, f"{run}: Accelerate trained but impel failed: {mine['error']}"
        diff = (mine["params"] - theirs["params"]).abs().max().item()
        effect = (mine["params"] - trained["impel"][rank][f"no/{optim}"]["params"]).abs().max().item()
        print(f"{run} rank {rank}: max |impel - accelerate| = {diff:.3g} (tolerance {TOLERANCE:g}); "
              f"max |hook - plain all-reduce| = {effect:.3g} (must exceed {MIN_HOOK_EFFECT:g})")
        assert diff <= TOLERANCE, f"{run}: impel differs from Accelerate by {diff:.3g} > {TOLERANCE:g}"
        if not run.startswith("no/"):
            assert effect > MIN_HOOK_EFFECT, (f"{run}: the hook changed the parameters by only {effect:.3g} against "
                                              "plain all-reduce: was it registered?")
    if "params" in trained["impel"][0][run]:  # DDP keeps the replicas identical whatever the hook
        torch.testing.assert_close(trained["impel"][0][run]["params"], trained["impel"][1][run]["params"],
                                   rtol=0, atol=0)


def test_accelerate_ignores_a_plain_string_hook_which_impel_honours(trained):
    for rank in range(2):
        theirs = trained["accelerate"][rank]
        ignored = (theirs[ACCELERATE_IGNORES]["params"] - theirs["no/sgd"]["params"]).abs().max().item()
        honoured = (trained["impel"][rank][ACCELERATE_IGNORES]["params"] - theirs["fp16/sgd"]["params"]).abs().max()
        print(f"rank {rank}: Accelerate comm_hook='fp16' (str) vs no hook: {ignored:.3g}; impel comm_hook='fp16' (str) "
              f"vs Accelerate DDPCommunicationHookType.FP16: {honoured.item():.3g}")
        assert ignored == 0 and honoured.item() <= TOLERANCE


def test_precision_report_names_the_compressed_reduction(trained):
    expected = {"no/sgd": torch.float32, "fp16/sgd": torch.float16, "bf16/adamw": torch.bfloat16,
                "power_sgd/sgd": torch.float32, "power_sgd+fp16/adamw": torch.float16}
    for run, dtype in expected.items():
        if "params" in trained["impel"][0][run]:
            assert trained["impel"][0][run]["reduction"] == dtype, run
