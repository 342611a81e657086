"""FSDP2 with transformers models on 2 CPU ranks: layer detection, several models and optimizers in one prepare,
tied weights, activation checkpointing, RAM-efficient loading and the two FSDP rows of the precision table.

References: the same models trained under DDP (parameters within 1e-5 after 3 AdamW steps), the weights rank 0
loaded (exact), and the tensors themselves for every dtype the precision report states.
"""
from __future__ import annotations

import pytest
import torch

from impel.testing import run_on_ranks
from tiny_transformers import llama_config, tiny_bert, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.multiprocess

TOL = 1e-5


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))


def _train_trio(plugin):
    """GPT2 + Llama + Bert and two optimizers in one prepare; 3 steps; full state dicts."""
    from impel import Accelerator

    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    gpt2, llama, bert = tiny_gpt2(), tiny_llama(), tiny_bert()
    opt_a = torch.optim.AdamW(gpt2.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(list(llama.parameters()) + list(bert.parameters()), lr=1e-2)
    gpt2, opt_a, llama, bert, opt_b = acc.prepare(gpt2, opt_a, llama, bert, opt_b)
    ids = _batch(acc.process_index)
    for _ in range(3):
        loss = gpt2(input_ids=ids, labels=ids).loss + llama(input_ids=ids, labels=ids).loss
        loss = loss + bert(input_ids=ids, labels=torch.tensor([0, 1])).loss
        acc.backward(loss)
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    units = {name: sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")})
             for name, model in (("gpt2", gpt2), ("llama", llama), ("bert", bert))}
    states = [{k: v.detach().clone() for k, v in acc.get_state_dict(m).items()} for m in (gpt2, llama, bert)]
    inner = acc.unwrap_model(gpt2)
    return {"units": units, "tied": inner.lm_head.weight is inner.transformer.wte.weight, "states": states}


def _gpt2_checkpointed(plugin):
    from impel import Accelerator

    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ids = _batch(acc.process_index)
    for _ in range(3):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    wrappers = sum(type(m).__name__ == "FSDPCheckpointWrapper" for m in model.modules())
    return wrappers, {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


def _models_job():
    from impel import FullyShardedDataParallelPlugin

    ddp, fsdp = _train_trio(None), _train_trio(FullyShardedDataParallelPlugin())
    diffs = [max(float((a[k] - b[k]).abs().max()) for k in a) for a, b in zip(ddp["states"], fsdp["states"])]
    keys_equal = [list(a) == list(b) for a, b in zip(ddp["states"], fsdp["states"])]
    gpt2 = fsdp["states"][0]
    tie_values = float((gpt2["lm_head.weight"] - gpt2["transformer.wte.weight"]).abs().max())
    wrappers, checkpointed = _gpt2_checkpointed(FullyShardedDataParallelPlugin(activation_checkpointing=True))
    ac_diff = max(float((checkpointed[k] - ddp["states"][0][k]).abs().max()) for k in checkpointed)
    return {"units": fsdp["units"], "tied": fsdp["tied"], "diffs": diffs, "keys_equal": keys_equal,
            "tie_values": tie_values, "wrappers": wrappers, "ac_diff": ac_diff,
            "ac_keys": sorted(checkpointed) == sorted(ddp["states"][0])}


# --- cpu_ram_efficient_loading ------------------------------------------------------------------------------------
def _ram_efficient_job(path: str):
    import os

    from torch import nn
    from transformers import AutoModelForCausalLM

    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))
    rank = acc.process_index
    # a plain module: rank 0 builds real weights (seed 7), init_context puts the others on the meta device
    torch.manual_seed(7 if rank == 0 else 8)
    with acc.init_context():
        plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    plain_meta = all(p.is_meta for p in plain.parameters())
    # transformers: rank 0 reads the checkpoint, the others build the architecture on meta (docs/design.md)
    if rank == 0:
        llama = AutoModelForCausalLM.from_pretrained(path)
    else:
        with acc.init_context():
            llama = AutoModelForCausalLM.from_config(llama_config())
    llama_meta = all(t.is_meta for t in list(llama.parameters()) + list(llama.buffers()))
    plain, llama = acc.prepare(plain, llama)
    ids = torch.arange(8).view(1, 8)
    return {"plain_meta": plain_meta, "llama_meta": llama_meta,
            "plain": {k: v.clone() for k, v in acc.get_state_dict(plain).items()},
            "llama": {k: v.clone() for k, v in acc.get_state_dict(llama).items()},
            "buffers": {k: v.clone() for k, v in llama.named_buffers()},
            "loss": float(llama(input_ids=ids, labels=ids).loss.detach()),
            "env": os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")}


def _transformers_job(path: str):
    """One job for everything that imports transformers in the ranks (the import dominates a job's time)."""
    return {"models": _models_job(), "loading": _ram_efficient_job(path)}


@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory):
    from torch import nn

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(7)
    plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).state_dict()
    llama = tiny_llama(seed=3)
    llama.save_pretrained(path)
    ids = torch.arange(8).view(1, 8)
    reference = {"plain": plain, "llama": llama.state_dict(),
                 "loss": float(llama(input_ids=ids, labels=ids).loss.detach()),
                 "buffers": dict(llama.named_buffers())}  # rotary frequencies: non-persistent, not in the file
    return reference, run_on_ranks(_transformers_job, 2, args=(str(path),), timeout=240)


def test_transformers_models_detection_ties_checkpointing_match_ddp(transformers_run):
    for r in (rank["models"] for rank in transformers_run[1]):
        assert r["units"] == {"gpt2": ["FSDPGPT2Block", "FSDPGPT2LMHeadModel"],
                              "llama": ["FSDPLlamaDecoderLayer", "FSDPLlamaForCausalLM"],
                              "bert": ["FSDPBertEmbeddings", "FSDPBertForSequenceClassification", "FSDPBertLayer"]}
        assert r["keys_equal"] == [True, True, True]
        assert max(r["diffs"]) <= TOL, r["diffs"]
        assert r["tied"] and r["tie_values"] == 0.0
        assert r["wrappers"] == 2 and r["ac_keys"] and r["ac_diff"] <= TOL, r["ac_diff"]


def test_cpu_ram_efficient_loading_fills_meta_ranks_with_rank0_weights(transformers_run):
    reference, results = transformers_run
    results = [r["loading"] for r in results]
    assert [r["plain_meta"] for r in results] == [False, True]
    assert [r["llama_meta"] for r in results] == [False, True]
    for r in results:
        assert r["env"] == "true"  # transformers' from_pretrained sees Accelerate's variables
        assert all(torch.equal(r["plain"][k], v) for k, v in reference["plain"].items())
        assert all(torch.equal(r["llama"][k], v) for k, v in reference["llama"].items())
        assert all(torch.equal(r["buffers"][k], v) for k, v in reference["buffers"].items())
        assert r["loss"] == pytest.approx(reference["loss"], abs=1e-6)


# --- the precision table ------------------------------------------------------------------------------------------
def _precision_row(mixed_precision: str):
    """A bf16-loaded model trained one step; the report next to what the tensors say."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, mixed_precision=mixed_precision, fsdp_plugin=FullyShardedDataParallelPlugin())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.update(weight=m.weight.dtype, out=o.dtype))
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 8, dtype=torch.bfloat16)).float().square().mean())  # inputs as loaded
    grads = {p.grad.dtype for p in model.parameters()}
    opt.step()
    report = acc.precision_report()
    actual = {"stored_params": {p.to_local().dtype for p in model.parameters() if isinstance(p, DTensor)},
              "compute": {seen["weight"], seen["out"]}, "gradients": grads,
              "optimizer_states": {v.dtype for s in opt.state.values() for v in s.values() if v.dim()},
              "saved": {v.dtype for v in acc.get_state_dict(model).values()}}
    return report.as_dict(), actual, str(report)


@pytest.mark.parametrize("mixed_precision, stored, compute, reduced", [
    ("no", torch.bfloat16, torch.bfloat16, torch.bfloat16),  # trains fully in bf16, bf16 optimizer states
    ("bf16", torch.float32, torch.bfloat16, torch.float32),  # upcast at prepare, bf16 compute, fp32 step
])
def test_precision_table_rows(mixed_precision, stored, compute, reduced):
    for report, actual, text in run_on_ranks(_precision_row, 2, args=(mixed_precision,), timeout=120):
        assert report["stored_params"] == stored and actual["stored_params"] == {stored}
        assert report["compute"] == compute and actual["compute"] == {compute}
        assert report["gradients"] == stored and actual["gradients"] == {stored}
        assert report["reduction"] == reduced
        assert report["optimizer_states"] == stored and actual["optimizer_states"] == {stored}
        assert actual["saved"] == {stored}  # the checkpoint keeps the stored dtype (fp32 with mixed precision)
        assert "optimizer states" in text and report["mixed_precision"] == mixed_precision


def _fp16_skip_job():
    from torch import nn

    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=FullyShardedDataParallelPlugin())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    skipped = []
    for step in range(3):
        acc.backward(model(torch.randn(4, 6)).float().square().mean())
        if step == 1 and acc.process_index == 0:  # an overflow in rank 0's shard only
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
        skipped.append((acc.optimizer_step_was_skipped, acc.scaler.get_scale()))
    return skipped


def test_fp16_overflow_in_one_shard_skips_the_step_on_every_rank():
    # DTensor reduces GradScaler's found-inf flag across the mesh, so ranks agree
    expected = [(False, 65536.0), (True, 32768.0), (False, 32768.0)]
    assert run_on_ranks(_fp16_skip_job, 2, timeout=120) == [expected, expected]
