"""torch.compile through the Accelerator (``dynamo_backend`` / ``dynamo_plugin`` / ``dynamo_config`` / ``--dynamo_*``):
compiled training equals eager training (aot_eager: exactly, checked to 1e-6), the model really is compiled (dynamo's
graph counter must move), regional compilation compiles the repeated blocks in place, checkpoints keep the original
parameter names, ``unwrap_model(keep_torch_compile=...)`` both ways, the launched config reaches the Accelerator and
bad or unavailable backends raise naming themselves. One process; 2-rank DDP / FSDP2 are in tests/multiprocess."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from impel import Accelerator, ConfigError
from impel.config import environment as env
from impel.utils import DynamoBackend, TorchDynamoPlugin, has_compiled_regions, is_compiled_module

TOL = 1e-6  # aot_eager runs the same aten ops as eager: the parameters agree exactly in practice


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class TinyTransformer(nn.Module):
    """Repeated blocks in a ModuleList, as transformers models hold their layers."""

    def __init__(self, dim: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return self.out(h)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _train(acc: Accelerator, steps: int = 4, accumulation_batches: int = 1):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps * accumulation_batches):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(8, 4, generator=gen)).square().mean())
            opt.step()
            opt.zero_grad()
    return model, opt, {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def eager_reference():
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    ref = {accumulation: _train(Accelerator(cpu=True, gradient_accumulation_steps=accumulation),
                                accumulation_batches=accumulation)[2] for accumulation in (1, 2)}
    ProcessState._reset()
    return ref


def test_compiled_training_matches_eager_and_really_compiles(eager_reference):
    before = _graphs()
    acc = Accelerator(cpu=True, dynamo_backend="aot_eager", gradient_accumulation_steps=2)
    model, _, state = _train(acc, accumulation_batches=2)
    assert is_compiled_module(model)  # prepare returns the OptimizedModule, as Accelerate does
    assert _graphs() > before, "prepare did not compile the model (no dynamo graph was captured)"
    assert _diff(eager_reference[2], state) <= TOL
    assert acc.state.dynamo_plugin.backend == DynamoBackend.AOT_EAGER


def test_regional_compilation_compiles_each_block_in_place(eager_reference):
    before = _graphs()
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)
    model, _, state = _train(Accelerator(cpu=True, dynamo_plugin=plugin))
    assert not is_compiled_module(model)  # in place: the model and its parameter names are unchanged
    assert all(block._compiled_call_impl is not None for block in model.layers)
    assert has_compiled_regions(model)
    assert _graphs() > before
    assert _diff(eager_reference[1], state) <= TOL


def test_checkpoints_of_a_compiled_model_keep_the_original_names(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator(cpu=True, dynamo_backend="aot_eager")
    model, opt, state = _train(acc, steps=1)
    assert set(state) == set(TinyTransformer().state_dict())  # get_state_dict: no _orig_mod. prefix
    path = acc.save_state(tmp_path / "ckpt")
    saved = load_file(f"{path}/model.safetensors")
    assert set(saved) == set(state)
    acc.save_model(model, tmp_path / "weights")
    assert set(load_file(tmp_path / "weights" / "model.safetensors")) == set(state)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(path)
    assert _diff(state, acc.get_state_dict(model)) == 0.0


@pytest.mark.parametrize("keep", [True, False])
def test_unwrap_model_keep_torch_compile(keep):
    acc = Accelerator(cpu=True, dynamo_backend="aot_eager")
    model, _, _ = _train(acc, steps=1)
    unwrapped = acc.unwrap_model(model, keep_torch_compile=keep)
    if keep:
        assert is_compiled_module(unwrapped) and isinstance(unwrapped._orig_mod, TinyTransformer)
    else:
        assert type(unwrapped) is TinyTransformer
        assert not any("_orig_mod" in key for key in unwrapped.state_dict())
    x = torch.randn(3, 4)
    torch.testing.assert_close(unwrapped(x), model(x))


@pytest.mark.parametrize("make", [
    lambda: Accelerator(cpu=True, dynamo_backend="turbo"),
    lambda: Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="turbo")),
    lambda: TorchDynamoPlugin(backend="turbo"),
])
def test_an_unknown_backend_raises_naming_it(make):
    with pytest.raises(ConfigError, match="dynamo_backend='turbo' is not a torch.compile backend.*aot_eager"):
        make()


@pytest.mark.parametrize("backend,match", [
    ("tvm", "dynamo_backend='tvm' needs the tvm package, which is not installed: pip install apache-tvm"),
    ("cudagraphs", "dynamo_backend='cudagraphs' needs a CUDA device"),
    ("aot_ts_nvfuser", "dynamo_backend='aot_ts_nvfuser' no longer exists in torch"),
    ("neuron", "dynamo_backend='neuron' needs the torch_neuronx package"),
])
def test_a_backend_that_cannot_run_here_raises_with_the_fix(backend, match):
    with pytest.raises(ConfigError, match=match):
        Accelerator(cpu=True, dynamo_backend=backend)


def test_argument_errors():
    with pytest.raises(ConfigError, match="either dynamo_backend or dynamo_plugin"):
        Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    with pytest.raises(ConfigError, match="dynamo_mode='fastest' is not allowed"):
        TorchDynamoPlugin(backend="inductor", mode="fastest")
    with pytest.raises(ConfigError, match="either a mode or options"):
        TorchDynamoPlugin(backend="inductor", mode="max-autotune", options={"trace.enabled": True})


def test_plugin_defaults_and_kwargs_match_accelerates():
    plugin = TorchDynamoPlugin()
    assert (plugin.backend, plugin.mode, plugin.fullgraph, plugin.dynamic, plugin.use_regional_compilation,
            plugin.disable) == (DynamoBackend.NO, "default", False, None, False, False)
    plugin = TorchDynamoPlugin(backend=DynamoBackend.INDUCTOR, mode="max-autotune", dynamic=True)
    assert plugin.to_kwargs() == {"backend": "inductor", "mode": "max-autotune", "dynamic": True}
    assert "INDUCTOR" in DynamoBackend and "inductor" not in DynamoBackend
    acc = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", disable=True))
    model = acc.prepare(nn.Linear(2, 2))
    assert not is_compiled_module(model)  # disable=True: torch.compile is a no-op, as in Accelerate


def _launched(monkeypatch, explicit: dict) -> None:
    monkeypatch.setenv(env.CONFIG_VAR, env.launch_environment(explicit, None, None)[env.CONFIG_VAR])


def test_a_config_file_dynamo_section_reaches_the_accelerator(tmp_path, monkeypatch):
    from impel.config.yaml_file import read_config_file

    path = tmp_path / "accelerate.yaml"  # as `accelerate config` writes it
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: 'no'\n"
                    "dynamo_config:\n  dynamo_backend: AOT_EAGER\n  dynamo_mode: default\n"
                    "  dynamo_use_dynamic: false\n  dynamo_use_fullgraph: true\n"
                    "  dynamo_use_regional_compilation: true\n")
    explicit = read_config_file(str(path))
    _launched(monkeypatch, explicit)
    acc = Accelerator(cpu=True)
    plugin = acc.state.dynamo_plugin
    assert (plugin.backend, plugin.fullgraph, plugin.dynamic, plugin.use_regional_compilation) == (
        DynamoBackend.AOT_EAGER, True, False, True)
    assert TorchDynamoPlugin(mode="default").backend == DynamoBackend.AOT_EAGER  # None fields: the launched ones


def test_launch_flags_reach_the_accelerator_and_code_wins_with_one_log_line(monkeypatch, caplog):
    from impel.commands.flags import explicit_from_flags_list

    explicit = explicit_from_flags_list(["--dynamo_backend", "eager", "--dynamo_mode", "default",
                                         "--dynamo_use_fullgraph", "--dynamo_use_regional_compilation", "false"])
    assert explicit == {"dynamo_config": {"dynamo_backend": "EAGER", "dynamo_mode": "default",
                                          "dynamo_use_fullgraph": True, "dynamo_use_regional_compilation": False}}
    _launched(monkeypatch, explicit)
    acc = Accelerator(cpu=True)
    assert acc.state.dynamo_plugin.backend == DynamoBackend.EAGER
    with caplog.at_level(logging.WARNING, logger="impel"):
        acc = Accelerator(cpu=True, dynamo_backend="aot_eager")
    plugin = acc.state.dynamo_plugin
    assert plugin.backend == DynamoBackend.AOT_EAGER and plugin.fullgraph  # the rest of the launched section holds
    lines = [r.getMessage() for r in caplog.records if "dynamo_backend" in r.getMessage()]
    assert lines == ["the code sets dynamo_config.dynamo_backend='AOT_EAGER', which overrides the launched config's "
                     "dynamo_config.dynamo_backend='EAGER'"]


def test_accelerates_older_top_level_dynamo_backend_key_is_folded_in(tmp_path):
    from impel.config.yaml_file import read_config_file

    path = tmp_path / "old.yaml"
    path.write_text("distributed_type: 'NO'\ndynamo_backend: INDUCTOR\n")
    assert read_config_file(str(path)) == {"distributed_type": "NO", "dynamo_config": {"dynamo_backend": "INDUCTOR"}}
    path.write_text("distributed_type: 'NO'\ndynamo_backend: 'NO'\ndynamo_config: {}\n")
    assert read_config_file(str(path)) == {"distributed_type": "NO"}
    path.write_text("dynamo_config:\n  dynamo_backend: warp\n")
    with pytest.raises(ConfigError, match="dynamo_backend='warp' is not allowed"):
        read_config_file(str(path))


def test_deepspeed_with_a_backend_raises():
    from impel.config.run_config import RunConfig
    from impel.runtime.step.compile import settle_dynamo

    config = RunConfig.from_dict({"distributed_type": "DEEPSPEED", "dynamo_config": {"dynamo_backend": "eager"}})
    with pytest.raises(ConfigError, match="dynamo_backend='eager' under DeepSpeed is not supported yet"):
        settle_dynamo(config, None, torch.device("cpu"), "DEEPSPEED")
