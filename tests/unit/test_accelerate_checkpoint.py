"""``load_state`` of Accelerate 1.15 ``save_state`` directories on one process: what is restored, what is refused.

Accelerate itself writes the directories, once, in a child process (its state singletons stay out of this one):
a model, AdamW, a LambdaLR and a registered object after 3 steps, with safetensors and with
``safe_serialization=False``. impel loads copies of them here; some copies are damaged or doctored first.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_regression
from impel import Accelerator, CheckpointError, ProjectConfiguration
from impel.accelerator.load_accelerate_weights import match_names
from impel.checkpoint.io.restricted import Inert, RefusedGlobal, load_restricted
from impel.testing import run_on_ranks

accelerate = pytest.importorskip("accelerate")


class Counter:
    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": np.arange(3, dtype=np.float32)}  # a numpy array: allowlisted

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _write(root: str) -> dict:
    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate.utils import set_seed

    set_seed(0)
    acc = AccelerateAccelerator(cpu=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = make_regression(8).tensors
    for _ in range(3):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 8
    acc.save_state(f"{root}/safe")
    acc.save_state(f"{root}/bin", safe_serialization=False)
    params = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {"params": params, "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
            "last_epoch": sched.scheduler.last_epoch, "seen": counter.seen,
            "draws": (random.random(), float(np.random.rand()), torch.rand(3))}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    reference = run_on_ranks(_write, 1, args=(str(root),), env={"ACCELERATE_USE_CPU": "1"})[0]
    return root, reference


@pytest.fixture
def copy(written, tmp_path):
    """A fresh copy of an Accelerate directory (``copy("safe")``) to load or damage."""
    def make(name: str = "safe") -> Path:
        target = tmp_path / name
        shutil.copytree(written[0] / name, target)
        return target
    return make


def _prepare(models: int = 1, loader: bool = False, **kwargs):
    acc = Accelerator(cpu=True, **kwargs)
    torch.manual_seed(7)  # other weights than the saved ones
    objects = [_model() for _ in range(models)]
    opt = torch.optim.AdamW(objects[0].parameters(), lr=1e-2)
    objects += [opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))]
    if loader:
        objects.append(DataLoader(make_regression(16), batch_size=4, shuffle=True))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return (acc, counter, *acc.prepare(*objects))


@pytest.mark.parametrize("variant", ["safe", "bin"])
def test_model_optimizer_scheduler_rng_and_registered_object_come_back(written, copy, variant):
    reference = written[1]
    acc, counter, model, opt, sched = _prepare()
    directory = copy(variant)
    assert acc.load_state(directory) == str(directory)
    params = acc.unwrap_model(model).state_dict()
    for k, v in reference["params"].items():
        assert torch.equal(params[k], v), k
    for p, saved in zip(model.parameters(), reference["exp_avg"]):
        assert torch.equal(opt.state[p]["exp_avg"], saved)
    assert sched.scheduler.last_epoch == reference["last_epoch"] == 3
    assert counter.seen == reference["seen"] == 24
    # the next python, numpy and torch draws are the ones the Accelerate process made right after save_state
    assert (random.random(), float(np.random.rand())) == reference["draws"][:2]
    assert torch.equal(torch.rand(3), reference["draws"][2])


def _doctor(path: Path, marker: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"step": 0, "random_state": Payload()}, path)


@pytest.mark.parametrize("victim", ["random_states_0.pkl", "custom_checkpoint_0.pkl"])
def test_a_pickle_that_would_run_code_is_refused_and_nothing_is_loaded(copy, tmp_path, victim):
    directory, marker = copy(), tmp_path / "pwned"
    _doctor(directory / victim, marker)
    acc, counter, model, opt, sched = _prepare()
    before = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"refusing to load .*{victim}.*global (posix|os)\.system") as err:
        acc.load_state(directory)
    print(err.value)
    assert not marker.exists()
    after = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the refusal came before any change
    assert sched.scheduler.last_epoch == 0 and counter.seen == 0


def test_restricted_unpickler_allowlist(tmp_path):
    marker = tmp_path / "pwned"
    _doctor(tmp_path / "evil.pkl", marker)
    with pytest.raises(RefusedGlobal) as err:
        load_restricted(tmp_path / "evil.pkl")
    assert err.value.name in ("posix.system", "os.system")
    inert = load_restricted(tmp_path / "evil.pkl", inert=True)["random_state"]
    assert isinstance(inert, Inert) and inert.args == (f"touch {marker}",)  # recorded, never called
    assert not marker.exists()
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(state, tmp_path / "plain.pkl")
    loaded = load_restricted(tmp_path / "plain.pkl")
    assert loaded["python"] == state["python"] and torch.equal(loaded["torch"], state["torch"])
    assert (loaded["numpy"][1] == state["numpy"][1]).all()


@pytest.mark.parametrize(("removed", "message"), [
    ("optimizer.bin", r"optimizer\.bin is missing: the Accelerate checkpoint .* holds 0 optimizer state\(s\) but 1 "
                      "optimizers are prepared"),
    ("model.safetensors", r"model\.safetensors is missing: .* holds 0 model state\(s\) but 1 models"),
    ("scheduler.bin", r"scheduler\.bin is missing"),
    ("random_states_0.pkl", r"random_states_0\.pkl is missing: Accelerate's save_state writes one per rank"),
])
def test_a_missing_file_is_named(copy, removed, message):
    directory = copy()
    (directory / removed).unlink()
    acc, *_ = _prepare()
    with pytest.raises(CheckpointError, match=message):
        acc.load_state(directory)


def test_different_numbers_of_objects_are_named(copy):
    acc, *_ = _prepare(models=2)
    with pytest.raises(CheckpointError, match=r"holds 1 model state\(s\) \(model\.safetensors\) but 2 models are "
                                              "prepared now"):
        acc.load_state(copy())


def test_sampler_epoch_and_scaler_are_restored(copy):
    from accelerate.data_loader import SeedableRandomSampler

    directory = copy()
    sampler = SeedableRandomSampler(make_regression(16), data_seed=3)
    sampler.set_epoch(4)
    torch.save(sampler, directory / "sampler.bin")
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    torch.save(scaler.state_dict(), directory / "scaler.pt")
    acc, _, _, _, _, loader = _prepare(loader=True, mixed_precision="fp16")
    acc.load_state(directory)
    assert loader.epoch == 4
    assert acc.strategy.precision.state_dict()["scaler"]["scale"] == 512.0


def test_fp16_without_a_saved_scaler_names_scaler_pt(copy):
    acc, *_ = _prepare(mixed_precision="fp16")
    with pytest.raises(CheckpointError, match=r"scaler\.pt is missing: this run scales fp16 losses"):
        acc.load_state(copy())


def test_layouts_impel_cannot_load_say_the_way_out(copy):
    directory = copy()
    (directory / "pytorch_model_fsdp_0_rank0.bin").write_bytes(b"")
    acc, *_ = _prepare()
    with pytest.raises(CheckpointError, match=r"pytorch_model_fsdp_0_rank0\.bin is a per-rank FSDP shard.*save it "
                                              "again with fsdp_state_dict_type SHARDED_STATE_DICT"):
        acc.load_state(directory)
    (directory / "pytorch_model_fsdp_0_rank0.bin").unlink()
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model").mkdir()
    (directory / "pytorch_model" / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"pytorch_model is a DeepSpeed engine checkpoint; resume under "
                                              "DeepSpeed, or convert it .* zero_to_fp32"):
        acc.load_state(directory)


def test_automatic_naming_finds_the_newest_accelerate_checkpoint(written, tmp_path):
    root = tmp_path / "project" / "checkpoints"
    for n in (2, 3):
        shutil.copytree(written[0] / "safe", root / f"checkpoint_{n}")
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "project"),
                                                                    automatic_checkpoint_naming=True))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc.register_for_checkpointing(Counter())
    acc.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    assert acc.load_state() == str(root / "checkpoint_3")
    assert acc.project_configuration.iteration == 4


def test_wrapper_prefixes_and_tied_weights_are_matched():
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    stored = {"module.0.weight": torch.ones(4, 3)}  # DDP's prefix; the tied copy stored once
    matched = match_names(stored, model)
    assert set(matched) == {"0.weight", "1.weight"} and matched["1.weight"] is matched["0.weight"]
