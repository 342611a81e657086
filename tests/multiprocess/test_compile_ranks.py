"""torch.compile through the Accelerator on 2 CPU ranks (aot_eager): DDP (the whole model after the DDP wrapper, and
regional) and FSDP2 (per block before sharding, as torchtitan) each end with the same parameters as eager training
with the same Accelerator (to 1e-6; exact in practice), dynamo really captured graphs, and the state keeps the
original parameter names. Eager and compiled runs share one job to keep the rank start-up cost once per test."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

TOL = 1e-6


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class TinyTransformer(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return self.out(h)


def _fit(fsdp: bool, backend: str | None, regional: bool = False, sequential: bool = False):
    from torch._dynamo.utils import counters

    from impel import Accelerator, FullyShardedDataParallelPlugin
    from impel.utils import TorchDynamoPlugin

    kwargs = {}
    if fsdp:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap=None if sequential else ["Block"])
    if backend:
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend=backend, use_regional_compilation=regional)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, **kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)) if sequential else TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(8, 4, generator=gen)[acc.process_index * 4:(acc.process_index + 1) * 4]
        with acc.accumulate(model):
            acc.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
    state = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    unwrapped = [type(acc.unwrap_model(model, keep_torch_compile=keep)).__name__ for keep in (True, False)]
    return state, counters["stats"]["unique_graphs"] - before, [type(model).__name__, *unwrapped]


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _job(fsdp: bool, variants: dict):
    reference, _, _ = _fit(fsdp, None)
    out = {}
    for name, kwargs in variants.items():
        state, graphs, kind = _fit(fsdp, **kwargs)
        ref = _fit(fsdp, None, sequential=True)[0] if kwargs.get("sequential") else reference
        out[name] = (_diff(ref, state), graphs, kind, sorted(state))
    return out


def _check(results: list, variants: dict, kinds: dict) -> None:
    names = sorted(TinyTransformer().state_dict())
    for r in results:
        for name in variants:
            diff, graphs, kind, keys = r[name]
            assert diff <= TOL, (name, diff)
            assert graphs >= 1, f"{name}: nothing was compiled"
            assert kind == kinds[name], (name, kind)
            if not variants[name].get("sequential"):
                assert keys == names, (name, keys)  # no _orig_mod. anywhere


# (prepared model, unwrap_model(keep_torch_compile=True), unwrap_model(keep_torch_compile=False)) class names
@pytest.mark.slow  # ~10 s on 2 idle cores, ~20 s on loaded ones (three trainings, two of them compiled)
def test_ddp_compiled_matches_eager():
    variants = {"whole": {"backend": "aot_eager"}, "regional": {"backend": "aot_eager", "regional": True}}
    results = run_on_ranks(_job, 2, args=(False, variants), timeout=240)
    _check(results, variants, {"whole": ["OptimizedModule", "OptimizedModule", "TinyTransformer"],
                               "regional": ["DistributedDataParallel", "TinyTransformer", "TinyTransformer"]})


def test_fsdp2_compiled_per_block_matches_eager():
    variants = {"blocks": {"backend": "aot_eager"},  # per block before sharding, as torchtitan
                "root": {"backend": "aot_eager", "sequential": True}}  # no repeated blocks: the root's forward
    results = run_on_ranks(_job, 2, args=(True, variants), timeout=240)
    _check(results, variants, {"blocks": ["FSDPTinyTransformer"] * 3, "root": ["FSDPSequential"] * 3})
