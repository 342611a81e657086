"""FSDP2 on 2 CPU ranks trains exactly like DDP: parameters, clipped gradient norms, accumulation.

Each job trains the same MLP with AdamW under DDP and under FSDP (one sharding strategy), with and without 4-step
accumulation, clipping at 0.5 so the clip really scales the gradients, and compares on every rank.
Tolerances: parameters 1e-5 absolute after 10 optimizer steps; gradient norms 1e-5 relative (the sharded norm is
summed in another order than DDP's).
"""
from __future__ import annotations

import pytest
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression, max_abs_diff
from impel.testing import run_on_ranks

JOB_TIMEOUT = 180
# the module fixture runs two jobs: pytest-timeout sits above their sum, so a hang is reported by run_on_ranks
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2 * JOB_TIMEOUT + 60)]

STEPS = 10
PARAM_TOL = 1e-5
NORM_RTOL = 1e-5


def _train(plugin, accumulation: int, hidden: int = 16):
    import torch

    from impel import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, fsdp_plugin=plugin)
    model = make_mlp(hidden=hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # created before prepare: FSDP must re-point it
    loader = DataLoader(make_regression(n=160), batch_size=2, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    norms, reduced_mid_group = [], []
    for i, (x, y) in enumerate(loader):
        if i == STEPS * accumulation:
            break
        acc.backward(nn.functional.mse_loss(model(x), y))
        if not acc.sync_gradients:  # FSDP2 with gradient sync off keeps unsharded grads to itself: no .grad yet
            reduced_mid_group.append(any(p.grad is not None for p in model.parameters()))
        norm = acc.clip_grad_norm_(model.parameters(), 0.5)
        if norm is not None:
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    return state, norms, acc, reduced_mid_group


def _compare(strategies: tuple[str, ...]):
    from impel import FullyShardedDataParallelPlugin

    reference = {accumulation: _train(None, accumulation)[:2] for accumulation in (1, 4)}
    out = {}
    for strategy in strategies:
        for accumulation, (ddp, ddp_norms) in reference.items():
            plugin = FullyShardedDataParallelPlugin(sharding_strategy=strategy)
            fsdp, fsdp_norms, acc, reduced_mid_group = _train(plugin, accumulation)
            out[strategy, accumulation] = {
                "param_diff": max_abs_diff(ddp, fsdp), "ddp_norms": ddp_norms, "fsdp_norms": fsdp_norms,
                "reduced_mid_group": reduced_mid_group,
                "types": type(acc.strategy).__name__, "report": acc.precision_report().strategy,
                "mesh": tuple(acc.strategy.mesh.shape)}
    return out


# one job per environment (the strategies share it and DDP's reference run)
JOBS = {"one_node": ((("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"),), {}),
        "two_nodes": ((("HYBRID_SHARD_ZERO2",),), {"LOCAL_WORLD_SIZE": "1"})}  # as if 2 nodes of 1 rank each


@pytest.fixture(scope="module")
def runs():
    return {name: run_on_ranks(_compare, 2, args=args, env=env, timeout=JOB_TIMEOUT)
            for name, (args, env) in JOBS.items()}


@pytest.mark.parametrize("strategy, job, mesh", [
    ("FULL_SHARD", "one_node", (2,)),
    ("SHARD_GRAD_OP", "one_node", (2,)),
    ("NO_SHARD", "one_node", (2, 1)),  # replicate 2 x shard 1
    ("HYBRID_SHARD", "one_node", (1, 2)),  # one node of 2 ranks: replicate 1 x shard 2
    ("HYBRID_SHARD_ZERO2", "two_nodes", (2, 1)),  # 2 nodes of 1 rank: replicate 2 x shard 1
])
def test_fsdp_matches_ddp(runs, strategy, job, mesh):
    for rank_result in runs[job]:
        for accumulation in (1, 4):
            r = rank_result[strategy, accumulation]
            assert r["types"] == "FSDPStrategy" and r["report"] == f"FSDP {strategy}" and r["mesh"] == mesh
            assert r["param_diff"] <= PARAM_TOL, (accumulation, r["param_diff"])
            assert len(r["fsdp_norms"]) == STEPS == len(r["ddp_norms"])
            assert r["fsdp_norms"] == pytest.approx(r["ddp_norms"], rel=NORM_RTOL)
            assert max(r["ddp_norms"]) > 0.5  # the clip was active, so clipping itself is compared too
            # 3 of every 4 micro-steps skip the reduction (set_requires_gradient_sync(False))
            assert r["reduced_mid_group"] == ([False] * 3 * STEPS if accumulation == 4 else [])


def _bytes_per_rank(use_fsdp: bool):
    """Storage bytes of this rank's parameters, gradients and Adam states after one step (gradients kept)."""
    import torch
    from torch.distributed.tensor import DTensor

    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin() if use_fsdp else None)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 64)).square().mean())
    opt.step()

    params = list(model.parameters())
    tensors = params + [p.grad for p in params] + [v for s in opt.state.values() for v in s.values() if v.dim()]
    storages = {}  # by address: FSDP's sharded gradients are views into one reduce-scatter buffer
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _both_byte_counts():
    return _bytes_per_rank(False), _bytes_per_rank(True)


def test_full_shard_holds_half_of_ddp_bytes_per_rank():
    for ddp_bytes, fsdp_bytes in run_on_ranks(_both_byte_counts, 2, timeout=120):
        # 33,088 parameters: DDP holds 4 copies (param, grad, exp_avg, exp_avg_sq) of all; FSDP half of each
        assert ddp_bytes == 4 * 4 * 33_088
        assert 0.49 <= fsdp_bytes / ddp_bytes <= 0.51, (fsdp_bytes, ddp_bytes)
