"""A checkpoint written by an earlier impel (manifest format version 2: sha256 per block) keeps loading, verified."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import make_mlp
from impel import Accelerator, CheckpointError

FIXTURE = Path(__file__).parent.parent / "fixtures" / "checkpoint_v2"  # tests/fixtures/make_checkpoint_v2.py


def prepared():
    acc = Accelerator(cpu=True)
    model = make_mlp(seed=3)  # other weights than the fixture's: the load must replace them
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return acc, *acc.prepare(model, opt, sched)


def test_a_format_version_2_checkpoint_loads(tmp_path):
    ckpt = shutil.copytree(FIXTURE, tmp_path / "checkpoint_v2")
    acc, model, opt, sched = prepared()
    acc.load_state(ckpt)
    saved = load_file(ckpt / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert [float(s["step"]) for s in opt.state.values()] == [2.0] * 4
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.0025)


def test_a_corrupted_format_version_2_checkpoint_is_named(tmp_path):
    ckpt = shutil.copytree(FIXTURE, tmp_path / "checkpoint_v2")
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[1600] ^= 0x01
    (ckpt / "optimizer.pt").write_bytes(bytes(data))
    acc, *_ = prepared()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is corrupted \(bytes 1536-2048 differ"):
        acc.load_state(ckpt)
