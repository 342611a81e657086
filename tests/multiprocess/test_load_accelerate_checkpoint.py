"""``load_state`` of a directory written by Accelerate 1.15's ``save_state``, compared with Accelerate itself.

One script, run as Accelerate and renamed to impel. Accelerate trains two epochs (AdamW, a warm-up LambdaLR,
dropout, a registered counter) and calls ``save_state``. impel, in fresh processes, prepares the same objects, loads
Accelerate's directory and runs 15 more steps (into a third epoch and halfway through a fourth). The reference:

- with an unshuffled or a ``use_seedable_sampler=True`` loader, Accelerate's own continuation in the process that
  saved (its 15 steps after ``save_state``);
- with Accelerate's default shuffled loader (``use_seedable_sampler=False``), whose sampler generator Accelerate
  does not save, Accelerate loading its own directory in fresh processes: impel resumes as Accelerate resumes.

Parameters must agree within 1e-6 (they agree exactly: the same arithmetic is replayed from the same state), and
so must the batches, the learning rate, the registered object, ``accelerator.step`` and the next python, numpy and
torch random draws of every rank (the RNG states came back). The save is at an epoch end and the script calls
``set_epoch`` per epoch, as a resumable Accelerate script must: Accelerate saves neither the epoch nor the position
in it (see impel/accelerator/load_accelerate.py).

FSDP: Accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` (what its ``save_state`` calls under FSDP)
write SHARDED (DCP) and FULL layouts from an FSDP2 model on 2 CPU ranks; impel under FSDP loads each, and its full
parameters and AdamW states equal the writer's exactly. DeepSpeed: an engine checkpoint written by the call
Accelerate makes (``engine.save_checkpoint(dir, "pytorch_model")``) resumes under impel's DeepSpeed exactly.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_regression
from impel.testing import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
accelerate = pytest.importorskip("accelerate")
ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}  # else Accelerate on a CPU box under torchrun trains unsynchronised
TOLERANCE = 1e-6
SAVED_EPOCHS, STEPS_AFTER = 2, 15


class Counter:
    """A registered object (Accelerate writes custom_checkpoint_0.pkl)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _script(framework: str, directory: str, shuffle: bool, seedable: bool, save: bool) -> dict:
    """``save``: train two epochs, ``save_state``, continue; else ``load_state`` and continue."""
    import random

    import numpy as np

    if framework == "accelerate":
        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.utils import set_seed
    else:
        from impel import Accelerator, DataLoaderConfiguration, set_seed
    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loader = DataLoader(make_regression(40), batch_size=4 // acc.num_processes, shuffle=shuffle)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    batches: list = []

    def train(first_epoch: int, steps: int) -> None:
        done, epoch = 0, first_epoch
        while done < steps:
            loader.set_epoch(epoch)
            for x, y in loader:
                batches.append(x[:, 0].tolist())
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
                counter.seen += len(x)
                done += 1
                if done == steps:
                    break
            epoch += 1

    if save:
        train(0, SAVED_EPOCHS * len(loader))
        acc.save_state(directory)
        batches.clear()
    else:
        acc.load_state(directory)
    train(SAVED_EPOCHS, STEPS_AFTER)
    inner = acc.unwrap_model(model)
    return {"params": {k: v.detach().clone() for k, v in inner.state_dict().items()}, "batches": batches,
            "lr": sched.get_last_lr(), "seen": counter.seen, "step": acc.step,
            "draws": (random.random(), float(np.random.rand()), torch.rand(3))}


def _compare(ours: list, theirs: list, label: str) -> None:
    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        diff = max(float((mine["params"][k] - ref["params"][k]).abs().max()) for k in ref["params"])
        print(f"{label} rank {rank}: max |impel - Accelerate| over parameters after {STEPS_AFTER} steps = {diff:.3g}")
        assert diff <= TOLERANCE
        assert mine["batches"] == ref["batches"] and len(ref["batches"]) == STEPS_AFTER
        assert mine["lr"] == ref["lr"] and mine["seen"] == ref["seen"] and mine["step"] == ref["step"]
        assert mine["draws"][:2] == ref["draws"][:2]
        assert torch.equal(mine["draws"][2], ref["draws"][2])


@pytest.mark.parametrize(("world", "shuffle"), [(2, False), (2, True), (1, True)])
def test_impel_continues_an_accelerate_run_from_its_save_state(world, shuffle, tmp_path):
    directory = str(tmp_path / "accelerate_checkpoint")
    theirs = run_on_ranks(_script, world, args=("accelerate", directory, shuffle, True, True), env=ACCELERATE_ENV)
    ours = run_on_ranks(_script, world, args=("impel", directory, shuffle, True, False))
    _compare(ours, theirs, f"world {world} shuffle {shuffle} (seedable sampler), vs Accelerate's continuation,")
    if shuffle:
        assert theirs[0]["batches"] != sorted(theirs[0]["batches"])  # really shuffled


@pytest.mark.parametrize("world", [2, 1])
def test_impel_resumes_an_accelerate_directory_as_accelerate_does(world, tmp_path):
    directory = str(tmp_path / "accelerate_checkpoint")
    run_on_ranks(_script, world, args=("accelerate", directory, True, False, True), env=ACCELERATE_ENV)
    theirs = run_on_ranks(_script, world, args=("accelerate", directory, True, False, False), env=ACCELERATE_ENV)
    ours = run_on_ranks(_script, world, args=("impel", directory, True, False, False))
    _compare(ours, theirs, f"world {world} default shuffle, vs Accelerate's own load_state,")


# --- FSDP layouts written by Accelerate's FSDP savers --------------------------------------------------------------
def _fsdp_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _full_states(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    optim = get_optimizer_state_dict(model, opt, options=options)
    return {"params": {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()},
            "exp_avg": {k: v["exp_avg"].clone() for k, v in optim["state"].items()},
            "exp_avg_sq": {k: v["exp_avg_sq"].clone() for k, v in optim["state"].items()}}


def _write_fsdp(root: str) -> dict:
    """An FSDP2 model trained 3 steps, saved by Accelerate's own functions as its save_state does under FSDP."""
    from accelerate import Accelerator
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import fully_shard

    acc = Accelerator(cpu=True)  # the process group, and the accelerator the savers ask for ranks
    torch.manual_seed(0)
    model = _fsdp_model()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    data = make_regression(24)
    for i in range(3):
        x, y = data.tensors[0][8 * i:8 * i + 8], data.tensors[1][8 * i:8 * i + 8]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)
        directory = f"{root}/{kind}"
        save_fsdp_model(plugin, acc, model, directory, 0)
        save_fsdp_optimizer(plugin, acc, opt, model, directory, 0)
        save_accelerator_state(directory, [], [], [sched], [], acc.process_index, 0)
    return dict(_full_states(model, opt), last_epoch=sched.last_epoch)


def _write_ddp(root: str) -> dict:
    """The same model and steps under Accelerate's DDP, saved by its save_state (positional optimizer state)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    model, opt, sched = acc.prepare(model, opt, sched)
    data = make_regression(48)
    rank = acc.process_index
    for i in range(3):
        x, y = data.tensors[0][16 * i + 8 * rank:16 * i + 8 * rank + 8], data.tensors[1][16 * i + 8 * rank:][:8]
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    acc.save_state(f"{root}/DDP")
    return dict(_full_states(acc.unwrap_model(model), opt.optimizer), last_epoch=sched.scheduler.last_epoch)


def _read_fsdp(directory: str) -> dict:
    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD"))
    torch.manual_seed(1)  # other initial weights: the load must replace them
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.load_state(directory)
    return dict(_full_states(model, opt.optimizer), last_epoch=sched.scheduler.last_epoch)


def test_impel_fsdp_loads_accelerate_fsdp_sharded_full_and_ddp_layouts(tmp_path):
    """FSDP's two layouts, and a DDP save_state directory (loaded into FSDP2 shards: a change of strategy)."""
    written = run_on_ranks(_write_fsdp, 2, args=(str(tmp_path),), env=ACCELERATE_ENV)[0]
    ddp = run_on_ranks(_write_ddp, 2, args=(str(tmp_path),), env=ACCELERATE_ENV)[0]
    assert (tmp_path / "SHARDED_STATE_DICT" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (tmp_path / "FULL_STATE_DICT" / "pytorch_model_fsdp.bin").is_file()
    assert (tmp_path / "DDP" / "optimizer.bin").is_file()
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT", "DDP"):
        expected = ddp if kind == "DDP" else written
        for rank, loaded in enumerate(run_on_ranks(_read_fsdp, 2, args=(str(tmp_path / kind),))):
            diff = max(float((loaded[part][k] - expected[part][k]).abs().max())
                       for part in ("params", "exp_avg", "exp_avg_sq") for k in expected[part])
            print(f"impel FSDP loading {kind} rank {rank}: max |loaded - saved| over parameters and AdamW states "
                  f"= {diff:.3g}")
            assert diff == 0.0
            # Accelerate's prepared scheduler steps once per process per optimizer step: 6 after 3 steps on 2 ranks
            assert loaded["last_epoch"] == expected["last_epoch"] == (6 if kind == "DDP" else 3)


# --- DeepSpeed engine checkpoints in Accelerate's layout -------------------------------------------------------------
def _deepspeed_run(directory: str, save: bool) -> dict:
    """ZeRO-2 on 2 CPU ranks. ``save``: train 3 steps, then write what Accelerate's save_state writes under DeepSpeed
    (``engine.save_checkpoint(dir, "pytorch_model")`` and random_states_<rank>.pkl), then train 2 more.
    Else: a fresh run loads that directory and trains the same 2 steps."""
    import random

    import numpy as np
    from deepspeed.utils import safe_get_full_fp32_param

    from helpers import make_mlp
    from impel import Accelerator, DeepSpeedPlugin

    acc = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    model = make_mlp(seed=0 if save else 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(40), batch_size=4))
    batches = list(loader)

    def steps(part: list) -> None:
        for x, y in part:
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    def masters() -> dict:
        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}

    if save:
        steps(batches[:3])
        model.save_checkpoint(directory, "pytorch_model")  # Accelerate's call, tag and all
        states = {"step": 0, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                  "torch_manual_seed": torch.get_rng_state()}
        torch.save(states, f"{directory}/random_states_{acc.process_index}.pkl")
    else:
        acc.load_state(directory)
    at_save = masters()
    steps(batches[3:5])
    return {"at_save": at_save, "after": masters()}


@pytest.mark.slow
def test_impel_deepspeed_loads_accelerate_deepspeed_layout(tmp_path):
    pytest.importorskip("deepspeed")
    directory = str(tmp_path / "ds")
    theirs = run_on_ranks(_deepspeed_run, 2, args=(directory, True), timeout=300)
    assert (tmp_path / "ds" / "pytorch_model" / "mp_rank_00_model_states.pt").is_file()
    ours = run_on_ranks(_deepspeed_run, 2, args=(directory, False), timeout=300)
    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        for part in ("at_save", "after"):
            diff = max(float((mine[part][k] - ref[part][k]).abs().max()) for k in ref[part])
            print(f"DeepSpeed ZeRO-2 rank {rank} {part}: max |impel - saved run| over fp32 masters = {diff:.3g}")
            assert diff <= TOLERANCE
