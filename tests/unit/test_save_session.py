"""The save path's state is explicit (issue 40): ``save_state`` hands one ``SaveSession`` to the strategy and every
writer, ``load_state`` one ``Manifest`` to every reader; no ``ContextVar`` decides anything and no lambda carries
the sync/async split. A writer that bypasses ``SaveSession.write`` fails an asynchronous save at once, naming the
file, instead of writing synchronously in the middle of it."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import impel
from checkpoint_helpers import prepared_mlp
from impel.checkpoint.formats import cooperative, full, full_slices, sharded
from impel.checkpoint.io import files
from impel.checkpoint.saving import registered
from impel.checkpoint.saving.session import SaveSession
from impel.checkpoint.saving.stager import Stager
from impel.checkpoint.store.layout import CheckpointError
from impel.strategies.base import REGISTRY, Strategy

ROOT = Path(impel.__file__).parent
WRITERS = [files.write_torch, files.write_safetensors, full.save_full, sharded.save_sharded,
           registered.write_registered, cooperative.write, cooperative.write_files]
READERS = [files.read_torch, files.read_safetensors, files.read_safetensors_file, full.read_weights,
           full.read_optimizer, full.load_full, sharded.load_sharded, sharded.load_full_state, full_slices.load_model,
           full_slices.load_optimizer]


def _strategies() -> list[type[Strategy]]:
    import importlib

    found = [Strategy]
    for where in REGISTRY.values():
        module, _, name = where.partition(":")
        found.append(getattr(importlib.import_module(module), name))
    return found


def _first(fn) -> inspect.Parameter:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return params[0]


@pytest.mark.parametrize("writer", WRITERS + [s.save_checkpoint for s in _strategies()],
                         ids=lambda f: f.__qualname__)
def test_every_writer_takes_the_session_first_and_required(writer):
    first = _first(writer)
    assert first.name == "session" and first.default is inspect.Parameter.empty, inspect.signature(writer)
    assert first.annotation in ("SaveSession", SaveSession), first.annotation


@pytest.mark.parametrize("reader", READERS + [s.load_checkpoint for s in _strategies()], ids=lambda f: f.__qualname__)
def test_every_reader_takes_the_manifest_first_and_required(reader):
    first = _first(reader)
    assert first.name == "manifest" and first.default is inspect.Parameter.empty, inspect.signature(reader)
    assert "Manifest" in str(first.annotation), first.annotation


def test_no_context_variable_and_no_lambda_on_the_save_path():
    checkpoint = sorted((ROOT / "checkpoint").rglob("*.py")) + [ROOT / "accelerator" / "save_load.py"]
    with_context = [p.relative_to(ROOT).as_posix() for p in checkpoint if "ContextVar" in p.read_text()]
    assert with_context == []
    tree = ast.parse((ROOT / "accelerator" / "save_load.py").read_text())
    lambdas = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Lambda)]
    assert lambdas == [], f"accelerator/save_load.py lines {lambdas}: name the step (a method or functools.partial)"


def test_a_writer_that_bypasses_the_session_fails_while_it_stages(tmp_path):
    session = SaveSession(tmp_path)
    with session.staging(Stager(pin_memory=False)) as deferred:
        session.write(files._write_torch, {"x": torch.ones(2)}, tmp_path / "recorded.pt")  # through write: recorded
        assert not (tmp_path / "recorded.pt").exists() and len(deferred.writes) == 1
        with pytest.raises(CheckpointError, match=r"bypass.pt was written while an asynchronous save staged"):
            files._write_torch(session, {"x": torch.ones(2)}, tmp_path / "bypass.pt")  # the primitive directly
    assert not (tmp_path / "bypass.pt").exists()
    deferred.run()  # replayed after staging: written (plainly: this session is not sealing)
    assert torch.load(tmp_path / "recorded.pt")["x"].tolist() == [1.0, 1.0]


def test_an_async_save_whose_writer_forgets_the_session_raises_at_the_call_and_commits_nothing(tmp_path, monkeypatch):
    """A writer that writes now instead of through ``SaveSession.write`` (here: the scheduler's file) fails the
    asynchronous save at its call, naming the file; nothing is committed and the next save works."""
    acc, _model, _opt = prepared_mlp(tmp_path)
    forgetful = files._write_torch  # writes at once, skipping the staging

    monkeypatch.setattr("impel.accelerator.save_load.write_torch", forgetful)
    with pytest.raises(CheckpointError, match=r"training_state.pt was written while an asynchronous save staged"):
        acc.save_state(async_save=True)
    acc.wait_for_checkpoint()
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    monkeypatch.undo()
    assert Path(acc.save_state(async_save=True)).name.startswith("checkpoint_")
    acc.wait_for_checkpoint()


def test_the_formats_table_is_what_the_writers_record_the_merger_runs_and_the_verifier_checks():
    import importlib

    from impel.checkpoint import formats
    from impel.checkpoint.formats import deepspeed_engines, merge
    from impel.checkpoint.io import verified

    assert {full.FORMAT, sharded.FORMAT, deepspeed_engines.FORMAT} == set(formats.FORMATS)
    for name, fmt in formats.FORMATS.items():
        module, _, attr = fmt.merger.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), fmt
        assert merge.MERGERS[name] == fmt.merger
    checked = ["model.safetensors", "model_1.safetensors", "optimizer.pt", "optimizer_2.safetensors",
               "pytorch_model.bin", "pytorch_model_1.bin", "scheduler.pt", "scheduler_1.pt", "training_state.pt",
               "custom_checkpoint_0.pt", "random_states_3.pt", "model/.metadata", "optimizer_1/__0_0.raw.distcp"]
    hashed_up_front = ["deepspeed/zero/mp_rank_00_model_states.pt", "extra.bin", "model.safetensors.bak",
                       "model/__0_0.distcp.tmp", "impel_checkpoint.json", "random_states.pt", "hook/model.pt"]
    assert [n for n in checked if not verified.checked_on_read(n)] == []
    assert [n for n in hashed_up_front if verified.checked_on_read(n)] == []
