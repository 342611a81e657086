"""Accelerate's helper functions under impel's paths give Accelerate's results (Accelerate, installed in the dev venv,
is the reference): tensor-structure operations, environment helpers, model unwrapping, the standalone data-loader
pieces, split_between_processes over a datasets.Dataset, and the small differences in errors and warnings."""
from __future__ import annotations

import collections
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

acc_ops = pytest.importorskip("accelerate.utils.operations")
import accelerate.data_loader as acc_dl  # noqa: E402
import accelerate.utils as acc_utils  # noqa: E402

import impel.data_loader as dl  # noqa: E402
import impel.utils as iu  # noqa: E402
from impel.utils import operations as ops  # noqa: E402

Pair = collections.namedtuple("Pair", "a b")


def _same(x, y):
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return type(x) is type(y) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


BATCHES = [{"x": torch.arange(6.0).view(2, 3), "y": [torch.tensor([1, 2]), Pair(torch.ones(2), torch.zeros(2))]},
           {"x": torch.arange(3.0).view(1, 3), "y": [torch.tensor([3]), Pair(torch.ones(1), torch.zeros(1))]}]


@pytest.mark.parametrize("name,args", [
    ("concatenate", (BATCHES,)), ("concatenate", ([torch.ones(2, 2), torch.zeros(1, 2)], 0)),
    ("concatenate", ([torch.ones(2, 2), torch.zeros(2, 1)], 1)), ("concatenate", ([[1, 2]],)),
    ("listify", (BATCHES[0],)), ("listify", (torch.tensor([1.5, 2.0], dtype=torch.bfloat16),)),
    ("find_batch_size", (BATCHES[0],)), ("find_batch_size", ([torch.ones(5, 2)],)),
    ("ignorant_find_batch_size", ({},)), ("ignorant_find_batch_size", ("text",)),
    ("convert_to_fp32", ({"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(2, dtype=torch.int64),
                          "c": "keep"},)),
    ("slice_tensors", (BATCHES[0], slice(0, 1))), ("find_device", (BATCHES[0],)), ("is_namedtuple", (Pair(1, 2),)),
    ("honor_type", (Pair(1, 2), iter([3, 4]))), ("pad_input_tensors", (torch.ones(3, 2), 3, 2)),
    ("pad_input_tensors", (torch.ones(5, 2), 5, 4)), ("get_data_structure", (BATCHES[0],)),
])
def test_operations_equal_accelerates(name, args):
    import copy

    mine = getattr(ops, name)(*copy.deepcopy(args))
    theirs = getattr(acc_ops, name)(*copy.deepcopy(args))
    if name == "get_data_structure":
        mine, theirs = str(mine).replace("impel.runtime.compat.operations.", ""), str(theirs).replace(
            "accelerate.utils.dataclasses.", "")
    assert _same(mine, theirs)


@pytest.mark.parametrize("name,args", [("concatenate", (["a", "b"],)), ("find_batch_size", ([],)),
                                       ("find_batch_size", ("x",))])
def test_operations_raise_where_accelerates_do(name, args):
    with pytest.raises(Exception) as theirs:
        getattr(acc_ops, name)(*args)
    with pytest.raises(type(theirs.value)):
        getattr(ops, name)(*args)


def test_convert_outputs_to_fp32_wraps_a_forward_and_unwraps():
    lin = nn.Linear(2, 2).to(torch.bfloat16)
    forward = ops.convert_outputs_to_fp32(lin.forward)
    out = forward(torch.ones(1, 2, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert torch.equal(out, acc_ops.convert_outputs_to_fp32(lin.forward)(torch.ones(1, 2, dtype=torch.bfloat16)))
    assert forward.__wrapped__.model_forward == lin.forward


def test_recursively_apply_takes_accelerates_arguments_and_leaves_other_leaves():
    data = {"t": torch.ones(2), "s": "text", "n": [3, torch.zeros(1)]}
    for fn in (iu.recursively_apply, acc_utils.recursively_apply):
        out = fn(lambda t, k: t + k, data, 2)
        assert out["s"] == "text" and out["n"][0] == 3 and torch.equal(out["t"], torch.full((2,), 3.0))
        with pytest.raises(TypeError):
            fn(lambda t: t, data, error_on_other_type=True)
        assert fn(lambda x: x * 10, [1, "a"], test_type=lambda x: isinstance(x, int)) == [10, "a"]
    messages = []
    for fn in (iu.recursively_apply, acc_utils.recursively_apply):
        with pytest.raises(TypeError) as raised:
            fn(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
        messages.append(str(raised.value))
    assert messages[0] == messages[1]  # Accelerate's sentence: code compares it


def test_saving_tied_tensors_warns_with_accelerates_words(tmp_path, caplog):
    shared = torch.ones(2)
    with caplog.at_level("WARNING"):
        iu.save({"a": shared, "b": shared}, tmp_path / "w.safetensors", safe_serialization=True)
    assert len(caplog.records) == 1 and "Removed shared tensor ['b']" in caplog.text


def test_send_to_device_skip_keys_as_accelerate():
    batch = {"a": torch.ones(1), "b": torch.ones(1, dtype=torch.float64)}
    moved = iu.send_to_device(batch, torch.device("meta"), skip_keys="b")
    ref = acc_utils.send_to_device(batch, torch.device("meta"), skip_keys="b")
    assert (moved["a"].device, moved["b"].device) == (ref["a"].device, ref["b"].device)
    assert iu.send_to_device(tensor=batch, device="meta", skip_keys=["a", "b"])["a"].device.type == "cpu"


# --- environment ---------------------------------------------------------------------------------------------------
def _environment_effects(module, monkeypatch):
    monkeypatch.setenv("IMPEL_T_KEEP", "1")
    monkeypatch.delenv("IMPEL_T_NEW", raising=False)
    seen = {}
    with module.patch_environment(impel_t_new=5, impel_t_keep="2"):
        seen["patched"] = (os.environ["IMPEL_T_NEW"], os.environ["IMPEL_T_KEEP"])
    seen["after_patch"] = (os.environ.get("IMPEL_T_NEW"), os.environ["IMPEL_T_KEEP"])
    with module.clear_environment():
        seen["cleared"] = dict(os.environ)
        os.environ["IMPEL_T_INSIDE"] = "x"
    seen["after_clear"] = (os.environ.get("IMPEL_T_INSIDE"), os.environ["IMPEL_T_KEEP"])

    monkeypatch.setenv("ACCELERATE_T_OLD", "a")

    @module.purge_accelerate_environment
    def sets():
        os.environ["ACCELERATE_T_OLD"] = "b"
        os.environ["ACCELERATE_T_NEW"] = "c"
        return "done"

    seen["purged_return"] = sets()
    seen["after_purge"] = (os.environ.get("ACCELERATE_T_OLD"), os.environ.get("ACCELERATE_T_NEW"))
    seen["flags"] = (module.str_to_bool("Yes"), module.str_to_bool("off", to_bool=True))
    return seen


def test_environment_helpers_equal_accelerates(monkeypatch):
    assert _environment_effects(iu, monkeypatch) == _environment_effects(acc_utils, monkeypatch)


def test_purge_accelerate_environment_wraps_a_test_class_and_its_subclasses(monkeypatch):
    monkeypatch.delenv("ACCELERATE_T_CLS", raising=False)

    @iu.purge_accelerate_environment
    class Base:
        def test_sets(self):
            os.environ["ACCELERATE_T_CLS"] = "1"

    class Child(Base):
        def test_child(self):
            os.environ["ACCELERATE_T_CLS"] = "2"

    Base().test_sets()
    Child().test_child()
    assert "ACCELERATE_T_CLS" not in os.environ


def test_str_to_bool_rejects_other_words_naming_them():
    with pytest.raises(ValueError, match="'maybe'"):
        iu.str_to_bool("maybe")


# --- models --------------------------------------------------------------------------------------------------------
def test_extract_model_from_parallel_strips_data_parallel_and_compile_as_accelerate():
    lin = nn.Linear(2, 2)
    for wrapped in (nn.DataParallel(lin), nn.DataParallel(nn.DataParallel(lin))):
        assert iu.extract_model_from_parallel(wrapped) is lin
        assert acc_utils.extract_model_from_parallel(wrapped) is lin
    compiled = torch.compile(nn.DataParallel(lin))
    assert iu.extract_model_from_parallel(compiled, keep_torch_compile=False) is lin
    kept = iu.extract_model_from_parallel(compiled)
    assert iu.is_compiled_module(kept) and kept._orig_mod is lin


def test_unwrap_model_strips_a_users_data_parallel():
    from impel import Accelerator

    lin = nn.Linear(2, 2)
    acc = Accelerator(cpu=True)
    assert acc.unwrap_model(nn.DataParallel(lin)) is lin
    assert acc.unwrap_model(torch.compile(nn.DataParallel(lin)), keep_torch_compile=False) is lin


def test_module_tools_equal_accelerates():
    import accelerate.utils.modeling as acc_modeling

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(4, 3)
            self.head = nn.Linear(3, 4, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    assert iu.find_tied_parameters(model) == acc_modeling.find_tied_parameters(model)
    for size in ("5GB", "5GiB", "100MB", "3Kb", 1234):
        assert iu.convert_file_size_to_int(size) == acc_modeling.convert_file_size_to_int(size), size
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool):
        assert iu.dtype_byte_size(dtype) == acc_modeling.dtype_byte_size(dtype)
    lin = nn.Linear(3, 2)
    assert iu.compute_module_sizes(lin) == dict(acc_modeling.compute_module_sizes(lin))
    assert iu.id_tensor_storage(lin.weight) == acc_modeling.id_tensor_storage(lin.weight)


# --- data ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,batch,drop_last,split,even", [
    (24, 4, False, False, True), (22, 4, False, False, True), (22, 4, True, False, True), (22, 4, False, False, False),
    (21, 3, False, False, True), (24, 4, False, True, True), (22, 4, False, True, True), (2, 4, False, False, True),
])
def test_batch_sampler_shard_equals_accelerates(n, batch, drop_last, split, even):
    sampler = BatchSampler(SequentialSampler(range(n)), batch, drop_last)
    for rank in range(2):
        mine = dl.BatchSamplerShard(sampler, 2, rank, split_batches=split, even_batches=even)
        theirs = acc_dl.BatchSamplerShard(sampler, 2, rank, split_batches=split, even_batches=even)
        assert list(mine) == list(theirs), rank
        assert len(mine) == len(theirs)


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("n,batch,drop_last,split", [(24, 4, False, False), (22, 4, False, False),
                                                     (22, 4, True, False), (22, 4, False, True), (3, 4, False, False)])
def test_iterable_dataset_shard_equals_accelerates(n, batch, drop_last, split):
    for rank in range(2):
        mine = dl.IterableDatasetShard(Stream(n), batch, drop_last, 2, rank, split_batches=split)
        theirs = acc_dl.IterableDatasetShard(Stream(n), batch, drop_last, 2, rank, split_batches=split)
        assert list(mine) == list(theirs), rank


def test_skip_batch_sampler_and_skip_data_loader_equal_accelerates():
    sampler = BatchSampler(range(10), 3, False)
    assert list(dl.SkipBatchSampler(sampler, 2)) == list(acc_dl.SkipBatchSampler(sampler, 2))
    assert len(dl.SkipBatchSampler(sampler, 2)) == len(acc_dl.SkipBatchSampler(sampler, 2))
    mine = dl.SkipDataLoader(list(range(10)), skip_batches=2, batch_size=3)
    theirs = acc_dl.SkipDataLoader(list(range(10)), skip_batches=2, batch_size=3)
    assert isinstance(mine, DataLoader)
    assert [b.tolist() for b in mine] == [b.tolist() for b in theirs]
    assert len(mine) == len(theirs)


@pytest.mark.parametrize("kwargs", [{"batch_size": 4}, {"batch_size": 4, "drop_last": True},
                                    {"batch_sampler": BatchSampler(SequentialSampler(range(22)), 4, False)}])
def test_prepare_data_loader_on_simulated_ranks_equals_accelerates(kwargs):
    for rank in range(2):
        mine = dl.prepare_data_loader(DataLoader(list(range(22)), **kwargs), num_processes=2, process_index=rank)
        theirs = acc_dl.prepare_data_loader(DataLoader(list(range(22)), **kwargs), num_processes=2,
                                            process_index=rank)
        assert [b.tolist() for b in mine] == [b.tolist() for b in theirs], rank


def test_prepare_data_loader_dispatches_as_accelerates_and_refuses_it_off_device():
    with pytest.raises(Exception, match="dispatch_batches=True.*put_on_device=True"):
        dl.prepare_data_loader(DataLoader(list(range(4)), batch_size=2), dispatch_batches=True)
    with pytest.raises(Exception, match="slice_fn_for_dispatch"):
        dl.prepare_data_loader(DataLoader(list(range(4)), batch_size=2), slice_fn_for_dispatch=lambda b, *a, **k: b)

    def halves(batch, part, process_index=None, num_processes=None):  # a custom cut: every other sample
        return batch[part.start * 2:part.stop * 2:2]

    for kwargs in ({"split_batches": True}, {}, {"slice_fn_for_dispatch": halves}):
        kwargs = {"put_on_device": True, "dispatch_batches": True, **kwargs}
        mine = dl.prepare_data_loader(DataLoader(list(range(10)), batch_size=4), **kwargs)
        theirs = acc_dl.prepare_data_loader(DataLoader(list(range(10)), batch_size=4), **kwargs)
        assert [b.tolist() for b in mine] == [b.tolist() for b in theirs], kwargs
        assert len(mine) == len(theirs)


def test_data_loader_dispatcher_built_directly_equals_accelerates():
    from accelerate.state import PartialState as AcceleratePartialState

    AcceleratePartialState(cpu=True)
    for kwargs in ({"batch_size": 3}, {"batch_size": 3, "drop_last": True},
                   {"batch_sampler": BatchSampler(SequentialSampler(range(10)), 4, True), "_drop_last": True}):
        mine = dl.DataLoaderDispatcher(list(range(10)), **kwargs)
        theirs = acc_dl.DataLoaderDispatcher(list(range(10)), **kwargs)
        assert isinstance(mine, DataLoader) and mine.drop_last == theirs.drop_last and len(mine) == len(theirs)
        assert [b.tolist() for b in mine] == [b.tolist() for b in theirs], kwargs
    mine, theirs = (m.DataLoaderDispatcher(list(range(10)), skip_batches=2, batch_size=3) for m in (dl, acc_dl))
    for _ in range(2):  # every pass starts 2 batches in, as Accelerate's
        assert [b.tolist() for b in mine] == [b.tolist() for b in theirs] == [[6, 7, 8], [9]]
    with pytest.raises(Exception, match="process_index=3"):
        dl.prepare_data_loader(DataLoader(list(range(4)), batch_size=2), num_processes=2, process_index=3)


def test_split_between_processes_over_a_datasets_dataset_equals_accelerates():
    datasets = pytest.importorskip("datasets")
    from impel.runtime.ranks.splitting import split_for_rank

    ds = datasets.Dataset.from_dict({"x": list(range(7))})
    for world in (1, 2, 3):
        for rank in range(world):
            for pad in (False, True):
                per, extra = divmod(7, world)
                start = rank * per + min(rank, extra)
                rows = list(range(start, start + per + (rank < extra)))
                if pad:
                    rows += [6] * (per + (extra > 0) - len(rows))  # Accelerate's padding: the last row repeated
                assert split_for_rank(ds, world, rank, pad)["x"] == rows
    from impel import PartialState

    with PartialState().split_between_processes(ds) as part:
        assert part["x"] == list(range(7))


def test_tracker_registration_warns_when_it_replaces_one():
    from impel.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class

    class Mine(GeneralTracker):
        name = "impel_test_tracker"
        requires_logging_directory = False

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            register_tracker_class(Mine)
        with pytest.warns(UserWarning, match="'impel_test_tracker' is already registered"):
            register_tracker_class(Mine)
    finally:
        LOGGER_TYPE_TO_CLASS.pop("impel_test_tracker", None)


def test_partial_state_members():
    from impel import PartialState

    state = PartialState(cpu=True)
    state.set_device()
    assert state.fork_launched is False and state.debug is False
    state.debug = True
    try:
        assert state.debug is True and iu.gather(torch.ones(1)).shape == (1,)  # one process: no check runs
    finally:
        state.debug = False


def test_random_sampler_is_left_to_torch_outside_prepare():
    loader = DataLoader(list(range(8)), sampler=RandomSampler(range(8)), batch_size=2)
    assert len(list(dl.prepare_data_loader(loader, num_processes=1, process_index=0))) == 4


class ListIndexed(torch.utils.data.Dataset):
    """Indexed by a list of indices at once (one fetch per batch), as Accelerate's test_distributed_data_loop's."""

    def __len__(self):
        return 22

    def __getitem__(self, index):
        return torch.tensor(index)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_batch_sampler_given_as_sampler_is_sharded_as_accelerate(drop_last):
    def loader():
        return DataLoader(ListIndexed(), sampler=BatchSampler(SequentialSampler(range(22)), 4, drop_last),
                          batch_size=None, collate_fn=lambda batch: batch)

    for rank in range(2):
        mine = dl.prepare_data_loader(loader(), num_processes=2, process_index=rank)
        theirs = acc_dl.prepare_data_loader(loader(), num_processes=2, process_index=rank)
        assert [b.tolist() for b in mine] == [b.tolist() for b in theirs], rank


# --- signatures' new arguments: each takes effect or raises ------------------------------------------------------
def test_prepare_arguments_take_effect_or_raise():
    from impel import Accelerator, ConfigError

    acc = Accelerator(cpu=True)
    model = acc.prepare_model(nn.Linear(2, 1), evaluation_mode=True)
    assert model(torch.ones(1, 2)).shape == (1, 1)
    opt = acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=True)
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ConfigError, match="device_placement=False"):
        acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False)
    with pytest.raises(ConfigError, match="slice_fn_for_dispatch.*not dispatched.*dispatch_batches=True"):
        acc.prepare_data_loader(DataLoader(list(range(4))), slice_fn_for_dispatch=lambda b, *a: b)
    with acc.trigger_sync_in_backward(model):  # one process: nothing to force
        model(torch.ones(1, 2)).sum().backward()


@pytest.mark.parametrize("plugin,kwargs", [
    ("FullyShardedDataParallelPlugin", {"ignored_modules": [nn.Linear(1, 1)]}),
    ("FullyShardedDataParallelPlugin", {"state_dict_config": object()}),
    ("FullyShardedDataParallelPlugin", {"optim_state_dict_config": object()}),
    ("FullyShardedDataParallelPlugin", {"limit_all_gathers": False}),
    ("FullyShardedDataParallelPlugin", {"param_init_fn": lambda m: m}),
    ("FullyShardedDataParallelPlugin", {"activation_checkpointing_offload": True}),
    ("DeepSpeedPlugin", {"transformer_moe_cls_names": "MoEBlock"}),
    ("DeepSpeedPlugin", {"enable_msamp": True}),
    ("DeepSpeedPlugin", {"msamp_opt_level": "O2"}),
])
def test_plugin_arguments_impel_does_not_drive_raise_naming_them(plugin, kwargs):
    import impel
    from impel import ConfigError

    cls = getattr(impel, plugin)
    cls(**({"limit_all_gathers": True} if "limit_all_gathers" in kwargs else {}))  # Accelerate's default: accepted
    with pytest.raises(ConfigError, match=f"{plugin}\\({next(iter(kwargs))}="):
        cls(**kwargs)


def test_synchronize_rng_state_without_a_type_names_the_choices():
    with pytest.raises(ValueError, match="'torch', 'cuda' or 'generator'"):
        iu.synchronize_rng_state()


def test_data_loader_state_mixin_is_the_type_of_prepared_loaders_as_accelerates():
    from impel import Accelerator

    prepared = {dl.DataLoaderStateMixin: Accelerator(cpu=True).prepare(DataLoader(list(range(4)), batch_size=2)),
                acc_dl.DataLoaderStateMixin: acc_dl.prepare_data_loader(DataLoader(list(range(4)), batch_size=2),
                                                                        num_processes=1, process_index=0)}
    for mixin, loader in prepared.items():
        assert isinstance(loader, mixin) and not isinstance(DataLoader(list(range(4))), mixin)

        class Mine(mixin):  # a loader of one's own: Accelerate's two attributes and reset()
            pass

        mine = Mine()
        mine.end_of_dataloader, mine.remainder = True, 3
        mine.reset()
        state = (Mine.end_of_dataloader, Mine.remainder, mine.end_of_dataloader, mine.remainder)
        assert state == (False, -1, False, -1)
    with pytest.raises(NotImplementedError, match="accelerator.prepare"):
        type("Own", (dl.DataLoaderStateMixin,), {})().begin()


def test_set_epoch_reaches_a_custom_batch_sampler_at_once_as_accelerates():
    from impel import Accelerator

    class EpochBatches(BatchSampler):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

    batches = EpochBatches(SequentialSampler(range(8)), 2, False)
    loader = Accelerator(cpu=True).prepare(DataLoader(list(range(8)), batch_sampler=batches))
    loader.set_epoch(3)
    assert batches.epoch == 3  # before any pass, as Accelerate's DataLoaderShard.set_epoch
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]] and batches.epoch == 3


def test_old_kernel_warning_carries_the_version_in_its_message_as_accelerates(caplog):
    from unittest import mock

    from accelerate.state import PartialState as AcceleratePartialState
    from accelerate.utils import check_os_kernel as theirs

    from impel.utils import check_os_kernel as mine

    AcceleratePartialState(cpu=True)  # Accelerate's logger needs its state
    messages = []
    with mock.patch("platform.uname", return_value=mock.Mock(release="5.4.0-35-generic", system="Linux")):
        for check in (mine, theirs):
            caplog.clear()
            with caplog.at_level("WARNING"):
                check()
            assert len(caplog.records) == 1
            messages.append(caplog.records[0].msg)
    assert all("5.4.0" in m and "5.5.0" in m for m in messages), messages


def test_convert_dict_to_env_variables_warns_on_the_environment_modules_logger(caplog):
    from impel.utils.environment import convert_dict_to_env_variables

    with caplog.at_level("WARNING", logger="impel.utils.environment"):
        lines = convert_dict_to_env_variables({"A": "1", "BAD": "<x", "B": "2"})
    assert lines == ["A=1\n", "B=2\n"]  # Accelerate's result
    assert [r.name for r in caplog.records] == ["impel.utils.environment"] and "BAD" in caplog.text
