"""Every kind of checkpoint file, damaged: one flipped byte, a truncated file, a missing file. The load fails naming
the file (and for a flipped byte the 64 MiB block's byte range), whether the file is checked while it is read
(impel's own files) or up front (a save hook's file). Loads read each file once: nothing is hashed in a pass of
its own."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import make_mlp
from impel import Accelerator, CheckpointError
from impel.checkpoint.io import hashing

KINDS = ["model.safetensors", "pytorch_model.bin", "optimizer.pt", "scheduler.pt", "training_state.pt",
         "random_states_0.pt", "custom_checkpoint_0.pt", "extra.bin"]


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def prepared(tmp_path, safe=True):
    acc = Accelerator(cpu=True)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.register_for_checkpointing(Counter())
    acc.backward(model(torch.randn(4, 6)).sum())
    opt.step()

    def hook(models, weights, out):
        (tmp_path / "hooked").write_bytes(b"h" * 3000)
        shutil.copy(tmp_path / "hooked", f"{out}/extra.bin")

    acc.register_save_state_pre_hook(hook)
    return acc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    for safe in (True, False):
        prepared(root, safe).save_state(root / f"ckpt_{safe}", safe_serialization=safe)
    return root


def damaged(saved, tmp_path, kind):
    source = saved / f"ckpt_{kind != 'pytorch_model.bin'}"
    return shutil.copytree(source, tmp_path / "ckpt")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_one_flipped_byte_in_any_file_is_named_with_its_byte_range(saved, tmp_path, kind, where):
    ckpt = damaged(saved, tmp_path, kind)
    data = bytearray((ckpt / kind).read_bytes())
    at = min(int(len(data) * where), len(data) - 1)  # the header, the middle, the last byte (a zip's directory)
    data[at] ^= 0x10
    (ckpt / kind).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{kind} is corrupted \(bytes 0-{len(data)} differ from the "
                                              r"manifest's xxh3_128 [0-9a-f]{12}\.\.\.\); load an earlier"):
        prepared(tmp_path, kind != "pytorch_model.bin").load_state(ckpt)


@pytest.mark.parametrize("kind", KINDS)
def test_a_truncated_or_missing_file_is_named(saved, tmp_path, kind):
    ckpt = damaged(saved, tmp_path, kind)
    size = (ckpt / kind).stat().st_size
    (ckpt / kind).write_bytes((ckpt / kind).read_bytes()[:size // 3])
    acc = prepared(tmp_path, kind != "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=rf"{kind} is truncated or corrupted \({size // 3} bytes, the "
                                              rf"manifest says {size} bytes\)"):
        acc.load_state(ckpt)
    (ckpt / kind).unlink()
    with pytest.raises(CheckpointError, match=rf"{kind} is missing; the checkpoint is incomplete"):
        acc.load_state(ckpt)


def test_a_load_reads_each_file_once_hashing_while_it_reads(saved, tmp_path, monkeypatch):
    """The only file hashed in a pass of its own is the hook's (no impel reader reads it); impel's files are
    hashed as their bytes arrive, each byte once."""
    from impel.checkpoint.io import verified

    ckpt = damaged(saved, tmp_path, "model.safetensors")
    acc = prepared(tmp_path)
    passes, hashed = [], []
    real_digest, real_update = hashing.block_digest, hashing.BlockHasher.update
    monkeypatch.setattr(hashing, "block_digest", lambda path, *a, **k: passes.append(path.name) or real_digest(
        path, *a, **k))
    monkeypatch.setattr(hashing.BlockHasher, "update", lambda self, data: hashed.append(memoryview(data).nbytes) or
                        real_update(self, data))
    acc.load_state(ckpt)
    assert passes == ["extra.bin"]
    read_checked = [p for p in ckpt.iterdir() if verified.checked_on_read(p.name)]
    assert {p.name for p in read_checked} == set(KINDS) - {"extra.bin", "pytorch_model.bin"}
    hook_file = (ckpt / "extra.bin").stat().st_size
    assert sum(hashed) == sum(p.stat().st_size for p in read_checked) + hook_file  # every byte once, no more
