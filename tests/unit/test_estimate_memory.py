"""The memory estimator's arithmetic (by hand, per strategy and dtype flow, and on an N-D mesh), model specs, tensor
parallel plans and the recommendation."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from impel.commands.planning.estimate import (
    ModelFacts,
    Setup,
    TensorParallelFacts,
    estimate_all,
    parse_bytes,
    recommend,
)
from impel.commands.planning.mesh import SIZES, check_mesh, estimate_mesh
from impel.commands.planning.model_spec import build_meta_model, model_facts, model_tp_plan
from impel.config.run_config import ConfigError

P = 1_000_000
FACTS = ModelFacts(name="m", params=P, largest_unit=100_000)
LLAMA = ("LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, "
         "num_attention_heads=2, num_key_value_heads=2)")


def by_name(setup: Setup) -> dict:
    return {e.strategy: e for e in estimate_all(FACTS, setup)}


def test_ddp_is_16_bytes_per_parameter_for_fp32_adamw_plus_buckets():
    ddp = by_name(Setup(world=4))["DDP"]
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.transient) == (4 * P, 4 * P, 8 * P, 4 * P)


def test_fsdp_full_shard_divides_by_the_world():
    e = by_name(Setup(world=4))["FSDP FULL_SHARD"]
    assert (e.params, e.grads, e.optimizer) == (P, P, 2 * P)
    assert e.transient == 2 * 100_000 * 4  # the gathered unit and the prefetched next one


def test_fsdp_keeps_the_load_dtype_without_mixed_precision():
    e = by_name(Setup(world=2, load_dtype="bf16"))["FSDP FULL_SHARD"]
    assert (e.params, e.grads, e.optimizer) == (P, P, 2 * P)  # 2 B/param, sharded over 2: bf16 weights and states


def test_fsdp_upcasts_to_fp32_with_mixed_precision():
    e = by_name(Setup(world=2, load_dtype="bf16", mixed_precision="bf16"))["FSDP FULL_SHARD"]
    assert (e.params, e.grads, e.optimizer) == (2 * P, 2 * P, 4 * P)  # 4 B/param over 2 ranks
    assert e.transient == 2 * 100_000 * 2  # gathered units in bf16


def test_shard_grad_op_keeps_the_model_gathered_between_forward_and_backward():
    e = by_name(Setup(world=2, mixed_precision="bf16"))["FSDP SHARD_GRAD_OP"]
    assert e.transient == 2 * P


def test_deepspeed_always_has_fp32_master_weights():
    s = by_name(Setup(world=4, load_dtype="bf16", mixed_precision="bf16"))
    z1, z2, z3 = s["ZeRO-1"], s["ZeRO-2"], s["ZeRO-3"]
    assert (z1.params, z1.grads, z1.optimizer) == (2 * P, 2 * P, 12 * P / 4)  # 16-bit model, fp32 master + 2 states
    assert (z2.params, z2.grads) == (2 * P, 2 * P / 4)
    assert (z3.params, z3.grads, z3.optimizer) == (2 * P / 4, 2 * P / 4, 12 * P / 4)
    z3_plain = by_name(Setup(world=4, load_dtype="bf16"))["ZeRO-3"]
    assert (z3_plain.params, z3_plain.optimizer) == (4 * P / 4, 12 * P / 4)  # upcast, and a separate fp32 master


def test_offload_moves_states_to_cpu():
    s = by_name(Setup(world=2))
    assert s["FSDP FULL_SHARD + offload"].params == 0 and s["FSDP FULL_SHARD + offload"].cpu == 16 * P / 2
    assert s["ZeRO-3 + offload"].optimizer == 0 and s["ZeRO-3 + offload"].cpu > 0


def test_sgd_has_no_states_and_hybrid_needs_machines():
    s = by_name(Setup(world=4, optimizer="sgd"))
    assert s["DDP"].optimizer == 0 and "FSDP HYBRID_SHARD" not in s
    h = by_name(Setup(world=4, machines=2))["FSDP HYBRID_SHARD"]
    assert h.params == 4 * P / 2  # sharded within a machine of 2 ranks


def test_activations_need_the_transformer_shape():
    assert by_name(Setup(world=1, batch_size=2, seq_len=8))["DDP"].activations is None
    facts = ModelFacts("t", P, P, layers=2, hidden=16, heads=2, vocab=10)
    est = estimate_all(facts, Setup(world=1, batch_size=2, seq_len=8))[0]
    assert est.activations == 2 * 34 * 8 * 2 * 16 * 4 / 2 + 2 * 2 * 8 * 10 * 4


def test_recommendation_is_the_cheapest_that_fits():
    est = estimate_all(FACTS, Setup(world=4))
    best, why = recommend(est, 20 * P)
    assert best.strategy == "DDP" and "cheapest strategy that fits" in why
    best, _ = recommend(est, 6 * P)  # ZeRO-2 needs 7P, SHARD_GRAD_OP 8P (gathered model), FULL_SHARD 4.8P
    assert best.strategy == "FSDP FULL_SHARD"
    assert recommend(est, 1)[0] is None and "nothing fits" in recommend(est, 1)[1]


def test_parse_bytes():
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1GiB") == 2**30 and parse_bytes("8e9") == 8e9
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes("lots")


def test_model_specs_build_on_meta_without_weights(tmp_path):
    model, _ = build_meta_model("GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32)")
    assert all(p.is_meta for p in model.parameters())
    facts = model_facts(model, "gpt2")
    assert facts.layers == 2 and facts.hidden == 64 and facts.vocab == 100
    assert facts.params == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    block = model.transformer.h[0]
    assert facts.largest_unit == sum(p.numel() for p in block.parameters())  # GPT2Block, from _no_split_modules
    model.config.save_pretrained(tmp_path)
    assert model_facts(*build_meta_model(str(tmp_path))).params == facts.params
    plain = model_facts(*build_meta_model("helpers:make_mlp"))
    assert plain.params == 6 * 16 + 16 + 16 + 1 and plain.largest_unit == plain.params


@pytest.mark.parametrize("spec,fragment", [("NoSuchConfig(a=1)", "transformers has no 'NoSuchConfig'"),
                                           ("GPT2Config(n_layer=x)", "must be literals"),
                                           ("nowhere:thing", "cannot be imported"),
                                           ("what is this", "is not a directory")])
def test_bad_model_specs(spec, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_meta_model(spec)


# --- the N-D mesh (dp_replicate x dp_shard x tp x cp): tensor parallel first, then FSDP2 over dp_shard x cp -------
S = 600_000  # parameters the tensor-parallel plan splits; the other 400k (norms, embeddings) stay whole
TP_FACTS = ModelFacts("t", P, 200_000, layers=2, hidden=16, heads=4, vocab=10, kv_heads=2,
                      tp=TensorParallelFacts("test", S, units=((200_000, 150_000),),
                                             split_dims=(("layers.0.mlp.up_proj.weight", 64),)))


def mesh_row(facts=TP_FACTS, **sizes):
    setup = Setup(**{"world": math.prod(sizes.get(k, 1) for k in SIZES), **sizes})
    check_mesh(facts, setup)
    return estimate_mesh(facts, setup)


def test_tensor_parallel_splits_only_what_the_plan_names():
    e = mesh_row(tp_size=2)
    per_rank = P - S + S / 2  # the replicated 400k whole, the split 600k halved
    assert (e.params, e.grads, e.optimizer, e.transient) == (4 * per_rank, 4 * per_rank, 8 * per_rank, 0)
    assert e.strategy == "TP (tp=2)" and "600,000 of 1,000,000 parameters" in e.notes[0]


def test_fsdp_and_hsdp_shard_what_each_tp_rank_holds():
    per_rank = P - S + S / 2
    fsdp = mesh_row(dp_shard_size=2, tp_size=2)
    assert (fsdp.params, fsdp.optimizer) == (4 * per_rank / 2, 8 * per_rank / 2)
    assert fsdp.transient == 2 * (200_000 - 150_000 / 2) * 4  # two gathered tp-local units
    hsdp = mesh_row(dp_replicate_size=2, dp_shard_size=2, tp_size=2)  # replicas hold the same shard
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (fsdp.params, fsdp.grads, fsdp.optimizer)
    assert (fsdp.strategy, hsdp.strategy) == ("FSDP x TP (dp_shard=2, tp=2)",
                                              "HSDP x TP (dp_replicate=2, dp_shard=2, tp=2)")
    mp = estimate_mesh(TP_FACTS, Setup(world=4, dp_shard_size=2, tp_size=2, load_dtype="bf16",
                                       mixed_precision="bf16"))
    assert mp.params == fsdp.params and mp.transient == fsdp.transient / 2  # fp32 upcast, gathered in bf16


def test_context_parallel_shards_the_model_with_dp_shard_and_splits_the_sequence():
    one = estimate_mesh(TP_FACTS, Setup(world=2, dp_shard_size=2, batch_size=2, seq_len=8))
    cp = mesh_row(dp_shard_size=2, cp_size=2, batch_size=2, seq_len=8)
    assert cp.params == one.params / 2  # FSDP shards over dp_shard x cp
    assert cp.activations == one.activations / 2  # every activation is per token
    assert cp.strategy == "FSDP x CP (dp_shard=2, cp=2)"


def test_tensor_parallel_splits_the_activations_inside_attention_and_the_mlp():
    layers = 2 * 8 * 2 * 16  # layers * s * b * h
    logits = 2 * 2 * 8 * 10 * 4
    assert mesh_row(tp_size=2, batch_size=2, seq_len=8).activations == layers * (10 + 24 / 2) * 4 / 2 + logits
    sp = dataclasses.replace(TP_FACTS, tp=dataclasses.replace(TP_FACTS.tp, sequence_parallel=True,
                                                               logits_sharded=True))
    assert mesh_row(sp, tp_size=2, batch_size=2, seq_len=8).activations == layers * 34 / 2 * 4 / 2 + logits / 2


def test_data_parallel_sizes_alone_are_ddp_and_fsdp():
    ddp = mesh_row(dp_replicate_size=2)
    assert (ddp.params, ddp.transient) == (4 * P, 4 * P) and ddp.strategy == "DDP (dp_replicate=2)"
    assert mesh_row(dp_shard_size=4).params == by_name(Setup(world=4))["FSDP FULL_SHARD"].params


@pytest.mark.parametrize("sizes,fragment", [
    (dict(world=8, tp_size=2), "= 2 ranks, but --num_processes is 8.*e.g. dp_shard_size 4"),
    (dict(world=4, dp_replicate_size=2, tp_size=2), "set dp_shard_size > 1"),
    (dict(world=3, tp_size=3), r"tp_size 3 does not divide num_attention_heads \(4\).*\(1, 2\)"),
    (dict(world=4, tp_size=4), r"tp_size 4 does not divide num_key_value_heads \(2\)"),
    (dict(world=2, cp_size=2, seq_len=9), "seq_len 9 is not divisible by cp_size 2.*multiple of 4"),
    (dict(world=2, tp_size=0), "tp_size must be a positive integer"),
])
def test_bad_meshes_name_the_value_and_the_fix(sizes, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_mesh(TP_FACTS, Setup(**sizes))


def test_a_model_without_a_plan_cannot_take_tensor_parallel():
    with pytest.raises(ConfigError, match="has no tensor-parallel plan.*--tp_plan.*or set tp_size 1"):
        check_mesh(FACTS, Setup(world=2, tp_size=2))


def test_the_llama_plan_is_the_one_tensor_parallel_applies():
    """The model's own plan (transformers merges the head's into the base model's): projections colwise/rowwise,
    the embedding split over the vocabulary, lm_head colwise with its logits gathered; the norms stay whole."""
    from impel.strategies.tensor_parallel import model_plan

    model, name = build_meta_model(LLAMA)
    facts = model_facts(model, name)
    assert model_tp_plan(model) == model_plan(model)  # the planner counts what prepare() does
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    in_layers = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in linears)
    split = in_layers + 2 * 64 * 16  # + embed_tokens and lm_head (not tied here)
    assert facts.tp.sharded == split and facts.tp.source == "the model's tp plan"
    assert facts.params - split == sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert facts.kv_heads == 2 and not facts.tp.logits_sharded and not facts.tp.sequence_parallel
    layer = model.model.layers[0]
    assert facts.tp.units == ((sum(p.numel() for p in layer.parameters()), in_layers // 2),)
    # a plan whose lm_head is plain colwise leaves the logits split over the tp ranks
    plan = {**model_tp_plan(model), "lm_head": "colwise"}
    more = model_facts(model, name, tp_plan=plan).tp
    assert more.sharded == split and more.logits_sharded and more.source == "the tp_plan passed"


def test_estimate_memory_command_prints_the_mesh(capsys):
    from impel.commands.main import main

    assert main(["estimate-memory", LLAMA, "--dp_shard_size", "2", "--parallelism_config_tp_size", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["world"] == 4 and [r["strategy"] for r in out["rows"]] == ["FSDP x TP (dp_shard=2, tp=2)"]
    assert out["rows"][0]["params_GB"] * 1e9 == (7248 - 7168 / 2) * 4 / 2
    assert main(["estimate-memory", LLAMA, "--tp_size", "3"]) == 2
    assert "tp_size 3 does not divide" in capsys.readouterr().err
    assert main(["estimate-memory", "GPT2Config(n_layer=1, n_embd=16, n_head=2)", "--tp_size", "2",
                 "--tp_plan", '{"transformer.h.*.mlp.c_fc": "colwise"}', "--json"]) == 0
    assert "'colwise' on transformer.h.0.mlp.c_fc counted as replicated" in capsys.readouterr().out  # a Conv1D
    assert main(["estimate-memory", LLAMA, "--tp_size", "2", "--tp_plan", "[1]"]) == 2
    assert "is not a JSON object" in capsys.readouterr().err


def test_a_plain_module_takes_a_user_plan():
    """nn.Sequential(Linear(6, 16), Tanh, Linear(16, 1)): colwise splits the first weight and bias, rowwise the
    second weight (its bias stays whole); with no transformer layer the model is the one unit FSDP gathers."""
    model, name = build_meta_model("helpers:make_mlp")
    tp = model_facts(model, name, tp_plan={"0": "colwise", "2": "rowwise"}).tp
    assert tp.sharded == 6 * 16 + 16 + 16 and tp.units == ((6 * 16 + 16 + 16 + 1, 128),)
    assert dict((size, where) for where, size in tp.split_dims) == {16: "0.weight"}
    assert mesh_row(model_facts(model, name, tp_plan={"0": "colwise", "2": "rowwise"}), tp_size=2).params == \
        4 * (1 + 128 / 2)
