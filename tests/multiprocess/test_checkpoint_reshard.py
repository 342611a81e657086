"""Checkpoints move between world sizes and strategies: FSDP (DCP, sharded) saved on 2 ranks resumes on 1 and the
other way round, a DDP checkpoint resumes under FSDP and an FSDP one under DDP. Each resumed run is compared with
the uninterrupted run of the same global batches (fp32; tolerance 1e-5: only the order of float reductions
differs between world sizes). merge_weights turns a sharded checkpoint into the model's full state dict."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from impel.testing import run_on_ranks

JOB_TIMEOUT = 240
# a test runs up to three jobs: pytest-timeout sits above their sum, so a hang is reported by run_on_ranks (with
# the ranks' stacks)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * JOB_TIMEOUT + 60)]
GLOBAL_BATCH, STEPS = 8, 4
FSDP = {"distributed_type": "FSDP", "use_cpu": True, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD",
                                                                    "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}
DDP = {"use_cpu": True}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    y = x.sum(1, keepdim=True).sin()
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _run(first_step: int, steps: int, load: str | None, save: str | None) -> dict[str, torch.Tensor]:
    from impel import Accelerator

    acc = Accelerator(step_scheduler_per_process=False)  # a schedule that is the same on every world size
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    if load:
        acc.load_state(load)
    for step in range(first_step, first_step + steps):
        x, y = _batch(step, acc.process_index, acc.num_processes)
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    if save:
        acc.save_state(save)
    state = acc.get_state_dict(model)
    acc.end_training()
    return {k: v.detach().clone() for k, v in state.items()}


def _on(world: int, launched: dict, *args):
    return run_on_ranks(_run, world, args=args, timeout=JOB_TIMEOUT, env={"IMPEL_CONFIG": json.dumps(launched)})[0]


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, f"max |dw| = {worst:.2e} > {tol}"


@pytest.mark.parametrize("saved,resumed", [((2, "FSDP"), (1, "FSDP")), ((1, "FSDP"), (2, "FSDP")),
                                           ((2, "DDP"), (2, "FSDP")), ((2, "FSDP"), (2, "DDP"))])
def test_resume_across_world_sizes_and_strategies(saved, resumed, tmp_path):
    configs = {"FSDP": FSDP, "DDP": DDP}
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = _on(saved[0], configs[saved[1]], 0, 2 * STEPS, None, None)
    _on(saved[0], configs[saved[1]], 0, STEPS, None, ckpt)
    continued = _on(resumed[0], configs[resumed[1]], STEPS, STEPS, ckpt, None)
    _close(continued, uninterrupted)


def test_merge_weights_of_a_sharded_checkpoint_equals_the_full_state_dict(tmp_path):
    from safetensors.torch import load_file

    from impel import merge_weights

    ckpt = str(tmp_path / "ckpt")
    full = _on(2, FSDP, 0, STEPS, None, ckpt)
    files = merge_weights(ckpt, tmp_path / "merged")
    merged = {k: v for f in files if str(f).endswith(".safetensors") for k, v in load_file(f).items()}
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[k], full[k]) for k in full)


def _run_small_blocks(*args):
    from impel.checkpoint.io import hashing

    hashing.BLOCK = 512  # many blocks per file, dealt to both ranks
    return _run(*args)


def test_the_manifest_of_a_two_rank_sharded_save_matches_every_file(tmp_path):
    """DCP's shards and metadata are hashed by the ranks in parallel (their blocks dealt round-robin), impel's own
    files while they are written; the committed manifest must list every file with the digests of the bytes on
    disk, and the checkpoint must load (which verifies every block)."""
    import xxhash

    from impel.checkpoint.store import layout

    ckpt = tmp_path / "ckpt"
    run_on_ranks(_run_small_blocks, 2, args=(0, STEPS, None, str(ckpt)), timeout=JOB_TIMEOUT,
                 env={"IMPEL_CONFIG": json.dumps(FSDP)})
    run_on_ranks(_run_small_blocks, 2, args=(STEPS, 1, str(ckpt), None), timeout=JOB_TIMEOUT,
                 env={"IMPEL_CONFIG": json.dumps(FSDP)})
    meta = json.loads((ckpt / layout.METADATA_FILE).read_text())
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {
        layout.METADATA_FILE, layout.MARKER_FILE}
    assert set(meta["files"]) == on_disk and any(rel.endswith(".distcp") for rel in on_disk)
    for rel, entry in meta["files"].items():
        data = (ckpt / rel).read_bytes()
        want = [xxhash.xxh3_128(data[i:i + 512]).hexdigest() for i in range(0, max(len(data), 1), 512)]
        assert entry == {"size": len(data), "xxh3_128_blocks": want}, rel
