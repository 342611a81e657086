"""Damaged files of a sharded (DCP) checkpoint saved by 2 FSDP ranks: a flipped byte in a shard file, in the file
of what every rank holds alike (the optimizer's steps and groups) or in DCP's metadata, a truncated shard, a
missing shard. Each fails the load naming the file; a 2-rank load of a damaged shard fails on every rank (the rank
that read it names the file, the other names that rank)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from torch import nn

from impel.testing import run_on_ranks

JOB_TIMEOUT = 240
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2 * JOB_TIMEOUT + 60)]
FSDP = {"distributed_type": "FSDP", "use_cpu": True, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD",
                                                                    "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}


def _job(save: str | None, load: str | None) -> str:
    from impel import Accelerator, CheckpointError

    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 6)).sum())
    opt.step()
    message = ""
    if save:
        acc.save_state(save)
    if load:
        try:
            acc.load_state(load)
        except CheckpointError as exc:
            message = str(exc)
    acc.end_training()
    return message


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("sharded") / "ckpt"
    run_on_ranks(_job, 2, args=(str(ckpt), None), timeout=JOB_TIMEOUT, env={"IMPEL_CONFIG": json.dumps(FSDP)})
    return ckpt


def _load_in_process(ckpt):
    """What load_state does with a DCP directory, on one process: sizes up front, checksums while reading."""
    from impel.checkpoint.formats import sharded
    from impel.checkpoint.io import verified
    from impel.checkpoint.store import layout

    metadata = layout.verify(ckpt, skip=verified.checked_on_read)
    return sharded.load_full_state(verified.Manifest.of(ckpt, metadata), ckpt / "optimizer")


@pytest.mark.parametrize("name", ["__0_0.raw.distcp", "__1_0.raw.distcp", "__0_1.raw.distcp", ".metadata"])
def test_a_flipped_byte_in_a_shard_or_the_dcp_metadata_is_named(sharded, tmp_path, name):
    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    assert _load_in_process(ckpt)["optimizer"]  # the undamaged copy loads
    data = bytearray((ckpt / "optimizer" / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / "optimizer" / name).write_bytes(bytes(data))
    from impel import CheckpointError

    with pytest.raises(CheckpointError,
                       match=rf"optimizer/{re.escape(name)} is corrupted \(bytes 0-{len(data)} differ"):
        _load_in_process(ckpt)


def test_a_truncated_or_missing_shard_is_named(sharded, tmp_path):
    from impel import CheckpointError

    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    shard = ckpt / "model" / "__1_0.raw.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"model/__1_0\.raw\.distcp is truncated or corrupted \(100 bytes, the "
                                              rf"manifest says {size} bytes\)"):
        _load_in_process(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"model/__1_0\.raw\.distcp is missing"):
        _load_in_process(ckpt)


def test_a_two_rank_load_of_a_damaged_shard_fails_on_every_rank(sharded, tmp_path):
    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    shard = ckpt / "model" / "__0_0.raw.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    messages = run_on_ranks(_job, 2, args=(None, str(ckpt)), timeout=JOB_TIMEOUT,
                            env={"IMPEL_CONFIG": json.dumps(FSDP)})
    assert all(m for m in messages), messages
    assert any("model/__0_0.raw.distcp is corrupted" in m for m in messages), messages
