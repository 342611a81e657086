"""Single-process behaviour of the Accelerate names impel adds, compared with Accelerate where it must match:
find_executable_batch_size, init_empty_weights / init_on_device, load_checkpoint_in_model, get_logger, save,
triggers, the state objects, the Accelerator's setters, profile, tqdm, the launchers' argument checks."""
from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import IndexDataset
from impel import Accelerator, ConfigError
from impel.config.environment import Topology


def pretend_rank(acc_or_state, rank: int, world: int = 2, local_rank: int | None = None) -> None:
    """Make the shared process state claim another rank, without a process group (the fixture resets it)."""
    local = rank if local_rank is None else local_rank
    acc_or_state.state.topology = Topology(rank=rank, world_size=world, local_rank=local, local_world_size=world)


def oom() -> RuntimeError:
    return RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


# --- find_executable_batch_size -------------------------------------------------------------------------------
def _tried_sizes(decorator, fits: int, start: int = 128) -> list[int]:
    tried: list[int] = []

    @decorator(starting_batch_size=start)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > fits:
            raise oom()
        return batch_size * scale

    assert train(2) == tried[-1] * 2
    return tried


def test_find_executable_batch_size_retries_like_accelerate():
    from impel.utils import find_executable_batch_size

    tried = _tried_sizes(find_executable_batch_size, fits=50)
    assert tried[0] == 128 and tried[-1] <= 50 and all(b < a for a, b in zip(tried, tried[1:]))
    accelerate_memory = pytest.importorskip("accelerate.utils.memory")
    assert tried == _tried_sizes(accelerate_memory.find_executable_batch_size, fits=50)


def test_find_executable_batch_size_errors():
    from impel import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=4)
    def never_fits(batch_size):
        raise torch.OutOfMemoryError("out of memory.")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        never_fits()

    calls = []

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        calls.append(batch_size)
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        broken()
    assert calls == [8]  # other errors are not retried

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: 2)
    def halves(batch_size):
        if batch_size > 2:
            raise oom()
        return batch_size

    assert halves() == 2

    @find_executable_batch_size
    def takes_size(batch_size):
        return batch_size

    with pytest.raises(TypeError, match="batch size as its first argument"):
        takes_size(16)


def test_release_memory_returns_nones():
    from impel.utils import release_memory

    a, b = torch.ones(3), torch.ones(4)
    assert release_memory(a, b) == [None, None]


# --- init_empty_weights / init_on_device ----------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def _devices(model: nn.Module) -> dict[str, str]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {n: t.device.type for n, t in named}


@pytest.mark.parametrize("include_buffers", [False, True])
def test_init_empty_weights_matches_accelerate(include_buffers):
    from impel import init_empty_weights

    register = nn.Module.register_parameter
    with init_empty_weights(include_buffers=include_buffers):
        model = Net()
    assert nn.Module.register_parameter is register  # restored
    devices = _devices(model)
    assert devices["embed.weight"] == "meta" and model.head.weight is model.embed.weight
    assert devices["norm.running_mean"] == ("meta" if include_buffers else "cpu")
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights(include_buffers=include_buffers):
        theirs = Net()
    assert devices == _devices(theirs)  # (Accelerate unties head.weight here; impel keeps the tie)


def test_init_on_device_keeps_parameter_flags():
    from impel import init_on_device

    with init_on_device("meta"):
        layer = nn.Linear(3, 2)
        layer.bias.requires_grad_(False)
        frozen = nn.Linear(2, 2)
    assert layer.weight.is_meta and isinstance(layer.weight, nn.Parameter) and not layer.bias.requires_grad
    assert frozen.weight.requires_grad


# --- load_checkpoint_in_model ---------------------------------------------------------------------------------
def _source() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("layout", ["safetensors_file", "bin_file", "sharded_folder", "index_file"])
def test_load_checkpoint_in_model_into_an_empty_model(tmp_path, layout):
    from impel import init_empty_weights, load_checkpoint_in_model
    from impel.checkpoint.formats.hf import save_pretrained_weights

    src = _source()
    state = src.state_dict()
    if layout == "safetensors_file":
        save_pretrained_weights(state, tmp_path)
        target = tmp_path / "model.safetensors"
    elif layout == "bin_file":
        torch.save(state, tmp_path / "weights.bin")
        target = tmp_path / "weights.bin"
    else:
        save_pretrained_weights(state, tmp_path, max_shard_size=200)
        target = tmp_path if layout == "sharded_folder" else tmp_path / "model.safetensors.index.json"
    with init_empty_weights():
        model = Net()
    load_checkpoint_in_model(model, target)
    for name, tensor in src.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model.head.weight is model.embed.weight  # still tied
    assert not any(t.is_meta for t in model.state_dict().values())


def test_load_checkpoint_in_model_matches_accelerate(tmp_path):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from impel.checkpoint.formats.hf import save_pretrained_weights
    from impel.utils import load_checkpoint_in_model

    save_pretrained_weights(_source().state_dict(), tmp_path)
    options = {"device_map": {"": "cpu"}, "dtype": torch.float16, "keep_in_fp32_modules": ["norm"]}
    ours, theirs = Net(), Net()
    load_checkpoint_in_model(ours, tmp_path, **options)
    accelerate_utils.load_checkpoint_in_model(theirs, str(tmp_path), **options)
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.embed.weight.dtype == torch.float16 and ours.norm.weight.dtype == torch.float32
    # without a device_map Accelerate ignores dtype; impel honours it (a documented difference)
    plain = Net()
    load_checkpoint_in_model(plain, tmp_path, dtype=torch.float16)
    assert plain.embed.weight.dtype == torch.float16


def test_load_checkpoint_in_model_refuses_what_it_cannot_do(tmp_path):
    from impel import load_checkpoint_in_model
    from impel.checkpoint.formats.hf import save_pretrained_weights

    save_pretrained_weights({"embed.weight": torch.ones(10, 4)}, tmp_path)
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_in_model(Net(), tmp_path, offload_folder=str(tmp_path))
    with pytest.raises(ValueError, match="'disk'"):
        load_checkpoint_in_model(Net(), tmp_path, device_map={"": "disk"})
    with pytest.raises(RuntimeError, match="missing .*norm.weight"):
        load_checkpoint_in_model(Net(), tmp_path, strict=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint_in_model(Net(), tmp_path / "nope")


class NotAWeight:
    """A pickled object of a user class: safe loading must refuse to rebuild it."""


def test_load_checkpoint_in_model_never_unpickles_code(tmp_path):
    from impel import load_checkpoint_in_model

    torch.save({"embed.weight": torch.ones(10, 4), "evil": NotAWeight()}, tmp_path / "w.bin")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        load_checkpoint_in_model(Net(), tmp_path / "w.bin")


# --- get_logger -----------------------------------------------------------------------------------------------
def test_get_logger_main_process_only(caplog):
    from impel.logging import get_logger

    logger = get_logger("impel.test.dropin", log_level="INFO")
    with pytest.raises(RuntimeError, match="create the Accelerator"):
        logger.info("too early")
    acc = Accelerator(cpu=True)
    with caplog.at_level(logging.INFO, logger="impel.test.dropin"):
        logger.info("hello %s", "world")
        logger.info("ordered", in_order=True)
        pretend_rank(acc, 1)
        logger.info("hidden on rank 1")
        logger.info("everyone", main_process_only=False)
        logger.debug("below the level", main_process_only=False)
    assert [r.getMessage() for r in caplog.records if r.name == "impel.test.dropin"] == [
        "[RANK 0] hello world", "[RANK 0] ordered", "[RANK 1] everyone"]


def test_get_logger_reads_accelerates_level_variable(monkeypatch):
    from impel.logging import get_logger

    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
    root_level = logging.getLogger().level
    try:
        assert get_logger("impel.test.level").logger.level == logging.DEBUG
    finally:
        logging.getLogger().setLevel(root_level)


# --- save -----------------------------------------------------------------------------------------------------
def test_save_writes_on_the_main_process_only(tmp_path):
    from impel.utils import save

    acc = Accelerator(cpu=True)
    state = {"w": torch.arange(4.0), "tied": None}
    state["tied"] = state["w"]
    acc.save(state, tmp_path / "a.pt")
    assert torch.load(tmp_path / "a.pt", weights_only=True)["w"].tolist() == [0, 1, 2, 3]
    acc.save({"w": torch.ones(2), "v": torch.zeros(1)}, tmp_path / "a.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "a.safetensors")) == {"w", "v"}
    pretend_rank(acc, 1, local_rank=0)
    acc.save({"x": torch.ones(1)}, tmp_path / "b.pt")
    assert not (tmp_path / "b.pt").exists()
    save({"x": torch.ones(1)}, tmp_path / "c.pt", save_on_each_node=True)  # local rank 0 of its node writes
    assert (tmp_path / "c.pt").exists()


def test_save_safetensors_needs_tensors_and_a_path(tmp_path):
    acc = Accelerator(cpu=True)
    with pytest.raises(TypeError, match="dict of tensors"):
        acc.save([1, 2], tmp_path / "x.safetensors", safe_serialization=True)
    with open(tmp_path / "y", "wb") as f, pytest.raises(TypeError, match="writes to a path"):
        acc.save({"w": torch.ones(1)}, f, safe_serialization=True)


# --- triggers, state objects, setters -------------------------------------------------------------------------
def test_set_and_check_trigger_on_one_process():
    acc = Accelerator(cpu=True)
    assert acc.flag_tensor is None and acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False  # cleared once it fired


def test_state_objects():
    from impel.runtime.ranks.process import AcceleratorState, GradientState, PartialState

    with pytest.raises(RuntimeError, match="create Accelerator"):
        AcceleratorState().mixed_precision  # noqa: B018
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    state = AcceleratorState()
    assert acc.state.__dict__ is state.__dict__ is PartialState().__dict__
    assert (state.mixed_precision, state.distributed_type, state.deepspeed_plugin, state.fsdp_plugin) == (
        "bf16", "NO", None, None)
    partial = PartialState()
    assert partial.distributed_type == "NO" and partial.process_index == 0 and partial.device.type == "cpu"
    with partial.split_between_processes(["a", "b"]) as mine:
        assert mine == ["a", "b"]
    assert partial.on_main_process(lambda: 7)() == 7
    assert GradientState() is acc.gradient_state  # Accelerate's shared state: the newest Accelerator's
    assert isinstance(acc.gradient_state, GradientState)


def test_gradient_accumulation_steps_setter_changes_the_grouping():
    acc = Accelerator(cpu=True)
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = acc.prepare(model, opt)
    acc.gradient_accumulation_steps = 2
    syncs = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(1, 1)).sum())
            syncs.append(acc.sync_gradients)
    assert syncs == [False, True, False, True]
    with pytest.raises(ConfigError, match="integer >= 1"):
        acc.gradient_accumulation_steps = 0
    acc.sync_gradients = False
    assert acc.sync_gradients is False
    with pytest.raises(ConfigError, match="True or False"):
        acc.sync_gradients = 1


def test_even_batches_setter_applies_to_loaders_prepared_afterwards():
    acc = Accelerator(cpu=True)
    acc.even_batches = False
    assert acc.even_batches is False
    loader = acc.prepare(DataLoader(IndexDataset(5), batch_size=2))
    assert loader.shard.even_batches is False
    with pytest.raises(ConfigError, match="even_batches="):
        acc.even_batches = "no"


def test_simple_members():
    acc = Accelerator(cpu=True)
    assert (acc.deepspeed_plugin, acc.multi_device, acc.is_fsdp2, acc.dispatch_batches, acc.fp8_enabled) == (
        None, False, False, False, False)
    assert acc.use_seedable_sampler is acc.dataloader_config.use_seedable_sampler
    assert acc.non_blocking is False and acc.native_amp is False and acc.profile_handler is None
    model = nn.Linear(1, 1)
    assert acc.verify_device_map(model) is False
    model.hf_device_map = {"a": 0, "b": 1}
    assert acc.verify_device_map(model) is True
    called = acc.on_local_process(lambda: "ran", local_process_index=0)()
    assert called == "ran" and acc.on_local_process(local_process_index=1)(lambda: "ran")() is None


def test_join_uneven_inputs_on_one_process_is_a_plain_block():
    acc = Accelerator(cpu=True)
    with acc.join_uneven_inputs([nn.Linear(1, 1)], even_batches=False):
        pass


# --- profile --------------------------------------------------------------------------------------------------
def test_profile_writes_a_chrome_trace_per_rank(tmp_path):
    from impel.utils import ProfileKwargs

    handler = ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=str(tmp_path / "trace"))
    acc = Accelerator(cpu=True, kwargs_handlers=[handler])
    assert acc.profile_handler is handler
    with acc.profile() as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert (tmp_path / "trace" / "profile_0.json").is_file()
    assert "aten::mm" in prof.key_averages().table()


def test_profile_kwargs_validate():
    from impel import ProfileKwargs

    with pytest.raises(ConfigError, match=r"'tpu'\]\) is not a profiler activity"):
        ProfileKwargs(activities=["tpu"])
    with pytest.raises(ConfigError, match="unknown keys \\['warm'\\]"):
        ProfileKwargs(schedule_option={"warm": 1})


# --- tqdm, launchers ------------------------------------------------------------------------------------------
def test_tqdm_draws_on_local_rank_zero_only():
    from impel.utils import tqdm

    acc = Accelerator(cpu=True)
    assert tqdm(range(3)).disable is False
    pretend_rank(acc, 1)
    assert tqdm(range(3)).disable is True
    assert tqdm(range(3), main_process_only=False).disable is False
    with pytest.raises(ValueError, match="main_process_only=True"):
        tqdm(True, range(3))


def test_notebook_launcher_checks_its_arguments():
    from impel import notebook_launcher

    ran = []
    notebook_launcher(lambda x: ran.append(x), args=(5,), num_processes=1)
    assert ran == [5]
    with pytest.raises(ConfigError, match="fp8"):
        notebook_launcher(print, num_processes=2, mixed_precision="fp8")
    with pytest.raises(ConfigError, match="num_processes=N"):
        notebook_launcher(print)
    Accelerator(cpu=True)
    with pytest.raises(ConfigError, match="already exists in this process"):
        notebook_launcher(print, num_processes=2)


# --- merge_fsdp_weights ---------------------------------------------------------------------------------------
def test_merge_fsdp_weights_from_an_impel_checkpoint_and_a_bare_dcp_directory(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from impel.checkpoint import CheckpointError
    from impel.utils import merge_fsdp_weights

    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(3, 2))
    saved = acc.save_state(str(tmp_path / "ckpt"))
    merge_fsdp_weights(saved, tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as one process"
        dcp.save(state, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"))
    merge_fsdp_weights(tmp_path / "pytorch_model_fsdp_0", tmp_path / "out2", safe_serialization=False,
                       remove_checkpoint_dir=True)
    assert torch.equal(torch.load(tmp_path / "out2" / "pytorch_model.bin", weights_only=True)["w"],
                       state["model"]["w"])
    assert not (tmp_path / "pytorch_model_fsdp_0").exists()
    with pytest.raises(CheckpointError, match="neither an impel checkpoint"):
        merge_fsdp_weights(tmp_path / "out", tmp_path / "out3")


# --- the active plugins ---------------------------------------------------------------------------------------
def test_fsdp_plugin_and_state_under_fsdp():
    from impel import FullyShardedDataParallelPlugin
    from impel.runtime.ranks.process import AcceleratorState

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP"))
    plugin = acc.fsdp_plugin
    assert plugin.sharding_strategy == "SHARD_GRAD_OP" and plugin is AcceleratorState().fsdp_plugin
    assert acc.is_fsdp2 and acc.deepspeed_plugin is None and AcceleratorState().distributed_type == "FSDP"


def test_deepspeed_plugin_from_code_or_from_the_launched_config(monkeypatch):
    pytest.importorskip("deepspeed")
    from impel import DeepSpeedPlugin
    from impel.runtime.ranks.process import AcceleratorState, ProcessState

    had_local_rank = "LOCAL_RANK" in os.environ
    given = DeepSpeedPlugin(zero_stage=2)
    acc = Accelerator(cpu=True, deepspeed_plugin=given)
    assert acc.deepspeed_plugin is given and AcceleratorState().deepspeed_plugin is given
    with pytest.raises(ConfigError, match="under DeepSpeed"):
        acc.gradient_accumulation_steps = 2
    acc.end_training()
    ProcessState._reset()
    monkeypatch.setenv("IMPEL_CONFIG", '{"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 1}}')
    launched = Accelerator(cpu=True)
    assert launched.deepspeed_plugin.zero_stage == 1 and launched.fsdp_plugin is None
    launched.end_training()
    # the LOCAL_RANK DeepSpeed needed is gone again: a later TrainingArguments (Accelerate's PartialState) would
    # otherwise take this process for a launched rank and start a process group (it did, in the unit tier)
    assert ("LOCAL_RANK" in os.environ) == had_local_rank
