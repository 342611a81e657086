"""The memory estimator's arithmetic (by hand, per strategy and dtype flow), model specs and the recommendation."""
from __future__ import annotations

import pytest

from impel.config import ConfigError
from impel.planning.estimate import ModelFacts, Setup, estimate_all, parse_bytes, recommend
from impel.planning.model_spec import build_meta_model, model_facts

P = 1_000_000
FACTS = ModelFacts(name="m", params=P, largest_unit=100_000)


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
