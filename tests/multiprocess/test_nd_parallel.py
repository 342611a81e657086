"""N-D parallelism on CPU ranks over gloo, against one process: TP=2 (2 ranks), FSDP x TP (2 x 2, 4 ranks) and
HSDP x TP (2 x 2 x 2, 8 ranks) each train a tiny Llama (built from a LlamaConfig; tensor parallel from its own plan)
for 10 AdamW steps with clipping, the first 5 plain and the last 5 accumulating 2 micro-batches, and end within
1e-5 of the same steps on one process over the same global batches (the clip norms too). The same runs check that
the TP ranks of one data-parallel rank read the same batches, that ``gather_for_metrics`` returns each sample once,
and that a checkpoint saved under FSDP x TP (DCP) loads under plain FSDP on 2 ranks and on one process within 1e-6
(weights and AdamW state), as does a TP=2 one, and one saved under HSDP x TP loads under plain FSDP;
``merge_weights`` gives the same full tensors. A plain module takes a user plan; one without a plan raises naming
what to pass; a model already split is kept as is."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from impel import merge_weights
from impel.testing import run_on_ranks

JOB_TIMEOUT = 240
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * JOB_TIMEOUT + 60)]
GLOBAL, SEQ, VOCAB = 4, 8, 64
PLAIN_STEPS, ACCUMULATED_STEPS = 5, 5  # 10 optimizer steps: 5 of one micro-batch, then 5 of two
BATCHES = PLAIN_STEPS + 2 * ACCUMULATED_STEPS
TOL, LOAD_TOL = 1e-5, 1e-6
EVAL_SAMPLES = 6  # not a multiple of the global eval batch: gather_for_metrics drops the padding


def _llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # 4 query heads, 2 key/value heads: each of 2 TP ranks keeps 2 and 1 of them
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


def _data() -> torch.utils.data.TensorDataset:
    ids = torch.randint(0, VOCAB, (BATCHES * GLOBAL, SEQ), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(ids)


def _reference(layers: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same 10 optimizer steps on one process, over the whole global batches."""
    model = _llama(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = iter(torch.utils.data.DataLoader(_data(), batch_size=GLOBAL))
    norms = []
    for step in range(PLAIN_STEPS + ACCUMULATED_STEPS):
        micro = 1 if step < PLAIN_STEPS else 2
        for _ in range(micro):
            (ids,) = next(batches)
            (model(input_ids=ids, labels=ids).loss / micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _prepared(acc, layers: int):
    """Model, AdamW, the training loader (GLOBAL samples per step over the data-parallel ranks) and an eval loader."""
    pc = acc.parallelism_config
    dp = pc.data_parallel_size if pc is not None else acc.num_processes
    model = _llama(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = torch.utils.data.DataLoader(_data(), batch_size=GLOBAL // dp)
    evaluation = torch.utils.data.DataLoader(torch.arange(EVAL_SAMPLES), batch_size=max(GLOBAL // dp // 2, 1))
    return acc.prepare(model, opt, train, evaluation)


def _train_and_check(sizes: dict[str, int], fsdp: bool, layers: int = 2, save: str | None = None) -> dict:
    """One rank of a mesh: train as _reference does, then the data, gather and checkpoint checks."""
    from impel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig(**sizes),
                      fsdp_plugin=FullyShardedDataParallelPlugin() if fsdp else None)
    model, opt, train, evaluation = _prepared(acc, layers)
    norms, first = [], None
    for i, (ids,) in enumerate(train):
        first = ids.clone() if first is None else first
        if i == PLAIN_STEPS:
            acc.gradient_accumulation_steps = 2
        with acc.accumulate(model):
            acc.backward(model(input_ids=ids, labels=ids).loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
    gathered = torch.cat([acc.gather_for_metrics(batch) for batch in evaluation]).tolist()
    pc, mesh = acc.parallelism_config, acc.torch_device_mesh
    from impel.runtime.ranks.process import AcceleratorState

    assert AcceleratorState().device_mesh is mesh and AcceleratorState().parallelism_config is pc
    assert pc.get_device_mesh() is mesh  # the ParallelismConfig passed in is the run's (as Accelerate's)
    dp_rank = pc.submesh("dp").get_local_rank() if pc.dp_dim_names else 0
    out = {"norms": norms, "first": first, "gathered": gathered, "tp_rank": acc.tensor_parallel_rank,
           "dp": (dp_rank, pc.data_parallel_coordinates(acc.process_index)[0]), "mesh": mesh.mesh_dim_names,
           "state": {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}}
    if save:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        acc.save_state(save)
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        out["optimizer"] = {k: {n: t.clone() for n, t in v.items() if n != "step"} for k, v in full["state"].items()}
    return out


def _fsdp_x_tp_job(save: str) -> dict:
    return _train_and_check({"dp_shard_size": 2, "tp_size": 2}, fsdp=True, save=save)


def _load_job(path: str, fsdp: bool, layers: int = 2) -> dict:
    """Load a checkpoint into a fresh run of this world (plain FSDP on 2 ranks, or one process)."""
    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin() if fsdp else None)
    model, opt, _, _ = _prepared(acc, layers)
    acc.load_state(path)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"state": {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()},
            "optimizer": {k: {n: t.clone() for n, t in v.items() if n != "step"} for k, v in full["state"].items()}}


def _plans_job() -> dict:
    """A plain module with a user plan (against one process), one without (the error), one already split."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from impel import Accelerator, ConfigError, ParallelismConfig
    from impel.utils import TorchTensorParallelConfig

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.LayerNorm(6))

    plan = TorchTensorParallelConfig(tp_plan={"0": "colwise", "2": ColwiseParallel(), "3": "replicate"})
    plan.tp_plan["2"] = RowwiseParallel()  # a torch ParallelStyle object works as well as a name
    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2, tp_handler=plan))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    out = {"mlp": {k: v.clone() for k, v in acc.get_state_dict(model).items()}}
    bare = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    try:
        bare.prepare(mlp())
    except ConfigError as exc:
        out["no_plan"] = str(exc)
    split = mlp()
    parallelize_module(split, bare.torch_device_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    before = [id(p) for p in split.parameters()]
    out["kept"] = [id(p) for p in bare.prepare(split).parameters()] == before
    tied = _llama(1)  # tied input / output embeddings: one parameter, split once
    tied.lm_head.weight = tied.model.embed_tokens.weight
    ids = _data().tensors[0][:GLOBAL]
    tied = bare.prepare(tied)
    out["tied"] = (tied.lm_head.weight is tied.model.embed_tokens.weight,
                   float(tied(input_ids=ids, labels=ids).loss.detach()))
    return out


def _tp_job(fsdp_x_tp: str, tp_save: str) -> dict:
    out = {"tp": _train_and_check({"tp_size": 2}, fsdp=False, save=tp_save)}
    out["fsdp_loads_fsdp_x_tp"] = _load_job(fsdp_x_tp, fsdp=True)
    out["plans"] = _plans_job()
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _check_run(ranks: list[dict], reference, tp: int) -> None:
    weights, norms = reference
    for rank, res in enumerate(ranks):
        assert _max_diff(res["state"], weights) < TOL, rank
        assert max(abs(a - b) for a, b in zip(res["norms"], norms)) < TOL and len(res["norms"]) == 10
        assert res["gathered"] == list(range(EVAL_SAMPLES))  # each sample once: no copy per TP rank
        assert res["tp_rank"] == rank % tp and res["dp"][0] == res["dp"][1]
        assert torch.equal(res["first"], ranks[rank - rank % tp]["first"])  # TP peers read the same batch
    firsts = [ranks[r]["first"] for r in range(0, len(ranks), tp)]
    assert torch.equal(torch.cat(firsts), _data().tensors[0][:GLOBAL])  # the data-parallel ranks split it


def _check_optimizer(loaded: dict, saved: dict) -> None:
    assert sorted(loaded) == sorted(saved)
    for name, state in saved.items():
        for key, value in state.items():
            assert float((loaded[name][key] - value).abs().max()) < LOAD_TOL, (name, key)


def test_tp_and_fsdp_x_tp_match_one_process_and_checkpoints_cross_meshes(tmp_path):
    reference = _reference(2)
    fsdp_x_tp, tp_dir = str(tmp_path / "fsdp_x_tp"), str(tmp_path / "tp")
    four = run_on_ranks(_fsdp_x_tp_job, 4, args=(fsdp_x_tp,), timeout=JOB_TIMEOUT)
    assert four[0]["mesh"] == ("dp_shard", "tp")
    _check_run(four, reference, tp=2)
    two = run_on_ranks(_tp_job, 2, args=(fsdp_x_tp, tp_dir), timeout=JOB_TIMEOUT)
    assert two[0]["tp"]["mesh"] == ("tp",)
    _check_run([r["tp"] for r in two], reference, tp=2)

    saved = four[0]["state"]
    for res in two:  # plain FSDP on 2 ranks resumes the FSDP x TP checkpoint
        assert _max_diff(res["fsdp_loads_fsdp_x_tp"]["state"], saved) < LOAD_TOL
        _check_optimizer(res["fsdp_loads_fsdp_x_tp"]["optimizer"], four[0]["optimizer"])
    for path, source in ((fsdp_x_tp, four[0]), (tp_dir, two[0]["tp"])):  # and one process, from both meshes
        one = _load_job(path, fsdp=False)
        assert _max_diff(one["state"], source["state"]) < LOAD_TOL
        _check_optimizer(one["optimizer"], source["optimizer"])
        files = merge_weights(path, tmp_path / f"{path.rsplit('/', 1)[-1]}_merged")  # impel merge-weights
        assert _max_diff({k: v for f in files for k, v in load_file(f).items()}, source["state"]) < LOAD_TOL

    plans = two[0]["plans"]
    from torch import nn

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.LayerNorm(6))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        mlp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert _max_diff(plans["mlp"], mlp.state_dict()) < TOL
    assert "tp_size=2: Sequential cannot be split: it has no tensor-parallel plan" in plans["no_plan"]
    assert "tp_handler=TorchTensorParallelConfig(tp_plan={'module.path': 'colwise' | 'rowwise'" in plans["no_plan"]
    assert "candidates: '0', '2'" in plans["no_plan"]
    assert plans["kept"]
    tied = _llama(1)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    ids = _data().tensors[0][:GLOBAL]
    assert plans["tied"][0] and abs(plans["tied"][1] - float(tied(input_ids=ids, labels=ids).loss.detach())) < TOL


def _hsdp_job(save: str) -> dict:
    return _train_and_check({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, fsdp=True, layers=1,
                            save=save)


def test_hsdp_x_tp_matches_one_process_and_its_checkpoint_loads_under_plain_fsdp(tmp_path):
    path = str(tmp_path / "hsdp_x_tp")
    ranks = run_on_ranks(_hsdp_job, 8, args=(path,), timeout=JOB_TIMEOUT)
    assert ranks[0]["mesh"] == ("dp_replicate", "dp_shard", "tp")
    _check_run(ranks, _reference(1), tp=2)
    for res in run_on_ranks(_load_job, 2, args=(path, True, 1), timeout=JOB_TIMEOUT):  # HSDP x TP -> FSDP
        assert _max_diff(res["state"], ranks[0]["state"]) < LOAD_TOL
        _check_optimizer(res["optimizer"], ranks[0]["optimizer"])
