"""The same script under ``impel launch`` with ``--use_fsdp --fsdp_*`` flags and with an ``fsdp_config`` YAML.

Both runs (2 CPU ranks, a real subprocess bounded by a timeout that kills its process group) must report FSDP with
SHARD_GRAD_OP and print the same final loss, to all printed digits (the runs are deterministic).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_helpers import impel

TIMEOUT_S = 180
# two launches per test: pytest-timeout sits above their sum, so a hang is reported by the launch's limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TIMEOUT_S + 60)]

SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from impel import Accelerator

acc = Accelerator()
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 6, generator=g)
y = x.sum(1, keepdim=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(x, y), batch_size=4))
for xb, yb in loader:
    loss = nn.functional.mse_loss(model(xb), yb)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
loss = acc.reduce(loss.detach(), "mean")
acc.print(f"result: type={acc.distributed_type} strategy={acc.strategy.sharding_strategy} loss={loss.item():.8f}")
'''

YAML = '''compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 2
use_cpu: true
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_auto_wrap_policy: NO_WRAP
  fsdp_state_dict_type: SHARDED_STATE_DICT
'''


def launch(args: list[str], cwd: Path) -> str:
    """Run ``impel launch`` (via tests/cli_helpers: no user config is read, bounded by a timeout)."""
    res = impel(["launch", *args, str(cwd / "train.py")], cwd, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.output[-6000:]
    results = re.findall(r"^result: (.*)$", res.stdout, flags=re.MULTILINE)
    assert len(results) == 1, res.output[-4000:]
    return results[0]


def test_fsdp_flags_and_yaml_give_the_same_run(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "fsdp.yaml").write_text(YAML)
    flags = launch(["--cpu", "--num_processes", "2", "--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
                    "--fsdp_auto_wrap_policy", "NO_WRAP"], tmp_path)
    from_yaml = launch(["--config_file", str(tmp_path / "fsdp.yaml")], tmp_path)
    assert flags.startswith("type=FSDP strategy=SHARD_GRAD_OP loss=")
    assert flags == from_yaml
