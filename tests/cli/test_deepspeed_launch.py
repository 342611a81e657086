"""One training script, three launches that differ only in flags: DDP, ``--use_deepspeed --zero_stage 2`` and
``--use_fsdp``, each on 2 CPU ranks through ``impel launch`` (a real subprocess bounded by a timeout that kills its
process group; the cache homes are empty folders, so no user config is read).

The loss curves (rank-averaged, every step) must agree within 1e-5 absolute + 1e-5 relative: all three average the
same float32 gradients over the same global batches; only the order of the reductions differs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_helpers import impel

TIMEOUT_S = 240
# three launches per test: pytest-timeout sits above their sum, so a hang is reported by the launch's limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT_S + 60)]
TOLERANCE = 1e-5

SCRIPT = '''
import json
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from impel import Accelerator

acc = Accelerator()
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 6, generator=g)
y = 0.3 * x.sum(1, keepdim=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(x, y), batch_size=4))
losses = []
for xb, yb in loader:
    loss = nn.functional.mse_loss(model(xb), yb)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(acc.reduce(loss.detach(), "mean").item())
acc.print("result: " + json.dumps({"type": str(acc.distributed_type), "losses": losses}))
acc.end_training()
'''


def launch(flags: list[str], cwd: Path) -> dict:
    """Run ``impel launch`` (via tests/cli_helpers: no user config is read, bounded by a timeout)."""
    res = impel(["launch", "--cpu", "--num_processes", "2", *flags, str(cwd / "train.py")], cwd, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.output[-6000:]
    results = re.findall(r"^result: (.*)$", res.stdout, flags=re.MULTILINE)
    assert len(results) == 1, res.output[-4000:]
    return json.loads(results[0])


def assert_same_curve(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == 12
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= TOLERANCE + TOLERANCE * abs(b), f"step {step}: {a} vs {b}"


def test_only_the_launch_flags_change_between_ddp_deepspeed_and_fsdp(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    ddp = launch([], tmp_path)
    deepspeed = launch(["--use_deepspeed", "--zero_stage", "2"], tmp_path)
    fsdp = launch(["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD"], tmp_path)
    assert (ddp["type"], deepspeed["type"], fsdp["type"]) == ("MULTI_CPU", "DEEPSPEED", "FSDP")
    assert sum(ddp["losses"][-4:]) < 0.5 * sum(ddp["losses"][:4])  # it learns
    assert_same_curve(deepspeed["losses"], ddp["losses"])
    assert_same_curve(fsdp["losses"], deepspeed["losses"])
