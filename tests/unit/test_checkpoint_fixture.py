"""Checkpoints written by earlier impel releases (manifest format version 2: sha256 per block; version 3: XXH3-128
per block) keep loading, verified."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import make_mlp
from impel import Accelerator, CheckpointError

FIXTURES = Path(__file__).parent.parent / "fixtures"  # checkpoint_v2, checkpoint_v3: tests/fixtures/make_checkpoint.py


def prepared():
    acc = Accelerator(cpu=True)
    model = make_mlp(seed=3)  # other weights than the fixture's: the load must replace them
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return acc, *acc.prepare(model, opt, sched)


@pytest.mark.parametrize("version", [2, 3])
def test_a_checkpoint_of_an_earlier_format_loads(tmp_path, version):
    ckpt = shutil.copytree(FIXTURES / f"checkpoint_v{version}", tmp_path / "checkpoint")
    acc, model, opt, sched = prepared()
    acc.load_state(ckpt)
    saved = load_file(ckpt / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert [float(s["step"]) for s in opt.state.values()] == [2.0] * 4
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.0025)


@pytest.mark.parametrize("version", [2, 3])
def test_a_corrupted_checkpoint_of_an_earlier_format_is_named(tmp_path, version):
    ckpt = shutil.copytree(FIXTURES / f"checkpoint_v{version}", tmp_path / "checkpoint")
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[1600] ^= 0x01
    (ckpt / "optimizer.pt").write_bytes(bytes(data))
    acc, *_ = prepared()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is corrupted \(bytes 1536-2048 differ"):
        acc.load_state(ckpt)


SHARDED = Path(__file__).parent.parent / "fixtures" / "sharded_v2"  # tests/fixtures/make_sharded_v2.py, 2 FSDP ranks


def _reference_training():
    """What the fixture's 2 ranks trained (both ranks saw the same batches: their mean gradient is this one's)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _load_sharded(ckpt, what):
    """load_state's checks on a DCP directory, on one process: sizes up front, checksums while reading."""
    from impel.checkpoint.formats import sharded
    from impel.checkpoint.io import verified
    from impel.checkpoint.store import layout

    metadata = layout.verify(ckpt, skip=verified.checked_on_read)
    assert metadata["format_version"] == 2
    return sharded.load_full_state(verified.Manifest.of(ckpt, metadata), ckpt / what)[what]


def test_a_sharded_checkpoint_with_torch_save_shards_loads(tmp_path):
    """DCP shard files of the previous release (one torch.save archive per chunk) still load, checked."""
    ckpt = shutil.copytree(SHARDED, tmp_path / "sharded_v2")
    model, opt = _reference_training()
    loaded = _load_sharded(ckpt, "model")
    assert loaded.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=1e-6)
    state = _load_sharded(ckpt, "optimizer")["state"]
    for name, param in model.named_parameters():
        torch.testing.assert_close(state[name]["exp_avg"], opt.state[param]["exp_avg"], rtol=0, atol=1e-6)
        assert float(state[name]["step"]) == 2.0
    data = bytearray((ckpt / "optimizer" / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x04
    (ckpt / "optimizer" / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer/__1_0\.distcp is corrupted \(bytes 0-\d+ differ from the "
                                              r"manifest's sha256"):
        _load_sharded(ckpt, "optimizer")
