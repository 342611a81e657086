"""FSDP FULL_STATE_DICT saves without gathering: each rank writes its shards' bytes into the full files
(checkpoint/formats/cooperative.py). On 2 ranks, with a tied embedding and a row count that does not split evenly: the
model file equals the gathered full state dict bit for bit (read back with safetensors' own reader), the optimizer
file equals the full optimizer state dict (tensors bit for bit, hyper-parameters equal, AdamW's betas still a
tuple in the file), an asynchronous save writes the same bytes (the state at the call, though the parameters
change before the write ends), the gathered path (``save_on_each_node``) writes the same model bytes, and a run
resumed from the cooperative checkpoint (on the same 2 ranks, and on one process without FSDP) continues bit for
bit. On 4 ranks, FSDP x TP: shards of shards land where the full tensors have them."""
from __future__ import annotations

import json
import os

import pytest
import torch

from impel.testing import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
FULL = {"distributed_type": "FSDP", "use_cpu": True,
        "fsdp_config": {"fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_auto_wrap_policy": "NO_WRAP"}}


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=37, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)  # vocab 37: FSDP's two shards of the embedding have 19 and 18 rows
    return GPT2LMHeadModel(cfg)


def _steps(acc, model, opt, first: int, n: int) -> None:
    for step in range(first, first + n):
        ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(100 * step + acc.process_index))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()


def _job(root: str) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from async_checkpoint_helpers import held_background
    from impel import Accelerator
    from impel.checkpoint.formats.full import read_optimizer

    acc = Accelerator()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    model, opt = acc.prepare(model, opt)
    _steps(acc, model, opt, 0, 2)
    acc.save_state(os.path.join(root, "coop"))
    with held_background() as gate:  # the background write waits until the parameters changed
        acc.save_state(os.path.join(root, "coop_async"), async_save=True)  # staged at the call, written later
        kept = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # what training does to the parameters while the background write runs
        gate.set()
        acc.wait_for_checkpoint()
    with torch.no_grad():
        for p, k in zip(model.parameters(), kept):
            p.copy_(k)
    full = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    full_opt = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if acc.is_main_process:  # cpu_offload: only rank 0 holds the gathered state; its step tensors are the live ones
        full_opt["state"] = {p: {k: v.clone() for k, v in s.items()} for p, s in full_opt["state"].items()}
    acc.project_configuration.save_on_each_node = True  # the checkpointer reads the same object
    acc.save_state(os.path.join(root, "gathered"))
    _steps(acc, model, opt, 2, 2)
    after = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    out: dict = {"files": sorted(os.listdir(os.path.join(root, "coop")))}
    if acc.is_main_process:
        coop = load_file(os.path.join(root, "coop", "model.safetensors"))
        gathered = load_file(os.path.join(root, "gathered", "model.safetensors"))
        out["model_vs_full"] = sorted(k for k in full if k in coop and not torch.equal(coop[k], full[k]))
        out["missing"] = sorted(set(full) - set(coop) - {"lm_head.weight"})  # tied: stored once, restored on load
        out["coop_vs_gathered"] = sorted(k for k in coop if not torch.equal(coop[k], gathered[k]))
        saved_opt = read_optimizer(None, __import__("pathlib").Path(root, "coop", "optimizer.safetensors"),
                                   "optimizer")
        out["groups_equal"] = saved_opt["param_groups"] == full_opt["param_groups"]
        out["opt_diff"] = sorted(f"{p}/{k}" for p, s in full_opt["state"].items() for k, v in s.items()
                                 if not torch.equal(saved_opt["state"][p][k], v))
        out["gathered_files"] = sorted(os.listdir(os.path.join(root, "gathered")))
        out["async_differs"] = [f for f in ("model.safetensors", "optimizer.safetensors") if open(
            os.path.join(root, "coop", f), "rb").read() != open(os.path.join(root, "coop_async", f), "rb").read()]
    acc.end_training()
    out["after"] = after
    return out


def _resume(root: str) -> dict:
    from impel import Accelerator

    acc = Accelerator()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    model, opt = acc.prepare(model, opt)
    acc.load_state(os.path.join(root, "coop"))
    _steps(acc, model, opt, 2, 2) if acc.num_processes == 2 else None
    state = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    groups = [dict(g, params=None) for g in opt.param_groups]
    acc.end_training()
    return {"state": state, "betas": [g["betas"] for g in groups]}


def test_ranks_write_their_shards_into_the_full_files(tmp_path):
    env = {"IMPEL_CONFIG": json.dumps(FULL)}
    first = run_on_ranks(_job, 2, args=(str(tmp_path),), timeout=90, env=env)
    main = first[0]
    assert "model.safetensors" in main["files"] and "optimizer.safetensors" in main["files"]
    assert "optimizer.pt" in main["gathered_files"]  # save_on_each_node: gathered on the writer as before
    assert main["model_vs_full"] == [] and main["missing"] == [] and main["coop_vs_gathered"] == []
    assert main["groups_equal"] and main["opt_diff"] == []
    assert main["async_differs"] == []  # save_state(async_save=True): the same bytes, from the call-time state
    resumed = run_on_ranks(_resume, 2, args=(str(tmp_path),), timeout=90, env=env)[0]
    assert all(torch.equal(resumed["state"][k], main["after"][k]) for k in main["after"])  # bit for bit
    assert [list(b) for b in resumed["betas"]] == [[0.8, 0.99]]  # (FSDP's loader makes any tuple a list)
    one = run_on_ranks(_resume, 1, args=(str(tmp_path),), timeout=90, env={"IMPEL_CONFIG": "{}"})[0]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "coop" / "model.safetensors"))
    assert all(torch.equal(one["state"][k], saved[k]) for k in saved)


def _fsdp_x_tp_job(root: str) -> dict | None:
    """FSDP x TP (2 x 2): FSDP's shards of tensor-parallel shards (torch's _StridedShard) are still boxes of the full
    tensor; the cooperative files must equal the gathered state, model and optimizer."""
    from pathlib import Path

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from impel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from impel.checkpoint.formats.full import read_optimizer
    from tiny_transformers import tiny_llama

    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
                      fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT"))
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(root)
    full = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    full_opt = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = None
    if acc.is_main_process:
        saved = load_file(os.path.join(root, "model.safetensors"))
        saved_opt = read_optimizer(None, Path(root, "optimizer.safetensors"), "optimizer")
        out = {"model_diff": [k for k in full if not torch.equal(saved[k], full[k])], "count": len(full),
               "opt_diff": [f"{p}/{k}" for p, s in full_opt["state"].items() for k, v in s.items()
                            if not torch.equal(saved_opt["state"][p][k], v)]}
    acc.end_training()
    return out


def test_fsdp_x_tp_shards_land_where_the_full_tensors_have_them(tmp_path):
    main = run_on_ranks(_fsdp_x_tp_job, 4, args=(str(tmp_path / "ckpt"),), timeout=120)[0]
    assert main["count"] > 10 and main["model_diff"] == [] and main["opt_diff"] == []


def _large_job(root: str) -> dict:
    """Tensors of several pages per rank, so each rank writes whole pages around the page cache and the unaligned
    ends through it; the manifest lists one block per range a rank wrote."""
    from safetensors.torch import load_file

    from impel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 1001), torch.nn.Linear(1001, 7))  # rows split 501 / 500
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 300)).pow(2).mean())
    opt.step()
    acc.save_state(root)
    full = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    out: dict = {}
    if acc.is_main_process:
        saved = load_file(os.path.join(root, "model.safetensors"))
        out["model_diff"] = [k for k in full if not torch.equal(saved[k], full[k])]
        with open(os.path.join(root, "impel_checkpoint.json")) as f:
            out["entries"] = {k: v for k, v in json.load(f)["files"].items() if k.endswith(".safetensors")}
    acc.end_training()
    return out


def _load_job(root: str) -> str:
    from impel import Accelerator

    acc = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(300, 1001), torch.nn.Linear(1001, 7))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    def read_bytes() -> int:  # what this process read through system calls (page cache included)
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])

    try:
        before = read_bytes()
        acc.load_state(root)
        return f"loaded {read_bytes() - before}"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        acc.end_training()


def test_each_rank_hashes_its_ranges_and_a_flipped_byte_in_them_is_named(tmp_path):
    from impel.checkpoint.store import layout

    env = {"IMPEL_CONFIG": json.dumps(FULL)}
    root = tmp_path / "ckpt"
    main = run_on_ranks(_large_job, 2, args=(str(root),), timeout=120, env=env)[0]
    assert main["model_diff"] == []
    entry = main["entries"]["model.safetensors"]
    ends = entry[layout.ENDS_KEY]
    assert ends[-1] == entry["size"] == (root / "model.safetensors").stat().st_size
    assert len(ends) == len(entry["xxh3_128_blocks"]) > 4  # header + tensors, ranges of both ranks
    loaded = run_on_ranks(_load_job, 2, args=(str(root),), timeout=120, env=env)
    assert all(r.startswith("loaded") for r in loaded), loaded
    # each rank reads and checks its own ranges only: the full files are read once in all, not once per rank
    full = sum((root / f).stat().st_size for f in ("model.safetensors", "optimizer.safetensors"))
    assert all(int(r.split()[1]) < 0.75 * full for r in loaded), (loaded, full)
    # one byte in the second half of the first weight (rank 1's rows, written around the page cache)
    data = bytearray((root / "model.safetensors").read_bytes())
    at = ends[-1] - 7 * 1001 * 4 - 7 * 4 - 1001 * 300 * 4 // 4  # names sorted: 0.weight, then 1.bias, 1.weight
    data[at] ^= 0x10
    (root / "model.safetensors").write_bytes(bytes(data))
    block = next(i for i, end in enumerate(ends) if end > at)
    lo = ends[block - 1] if block else 0
    results = run_on_ranks(_load_job, 2, args=(str(root),), timeout=120, env=env)
    assert any(f"model.safetensors is corrupted (bytes {lo}-{ends[block]} differ" in r for r in results), results
