"""save_state(async_save=True) on one process: the checkpoint holds the state at the call (training goes on while it
is written), bit for bit what a synchronous save of that state writes and loads; a background failure raises at
the next call naming the directory and the cause; the default comes from the config; exit waits for the write."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from async_checkpoint_helpers import assert_same_state, async_equals_sync

TESTS = Path(__file__).resolve().parents[1]


def test_async_save_is_the_call_time_state_and_a_background_failure_raises_at_the_next_call(tmp_path):
    out = async_equals_sync(str(tmp_path), fail_on_rank=0)
    assert out["returned"] == out["waited"] == str(tmp_path / "async")
    assert out["committed_early"] is False and out["again"] is None  # held until 3 more steps; waited once
    sync, asynchronous = out["manifests"]
    assert sync == asynchronous  # every file byte-identical (sizes and block digests)
    assert_same_state(*out["loaded"])
    assert out["error"].startswith(f"the asynchronous save_state() to {tmp_path / 'failed'} failed: OSError: "
                                   f"[Errno 28] no space left on {tmp_path / 'failed'}: the checkpoint needs ")
    assert out["failed_listing"] == ["async", "sync"]  # the half-written temporary directory is gone
    assert out["retry"] == str(tmp_path / "next")


@pytest.mark.parametrize("how", ["project_config", "config_key", "argument_over_config"])
def test_the_default_comes_from_project_configuration_or_the_config_key(how, tmp_path, monkeypatch):
    from impel import Accelerator, ProjectConfiguration

    if how != "project_config":
        monkeypatch.setenv("IMPEL_CONFIG", json.dumps({"async_save": True}))
    config = ProjectConfiguration(async_save=True) if how == "project_config" else None
    acc = Accelerator(cpu=True, project_config=config)
    acc.prepare(torch.nn.Linear(2, 2))  # something to save (save_state before prepare raises)
    target = str(tmp_path / "ckpt")
    if how == "argument_over_config":
        acc.save_state(target, async_save=False)
        assert acc.wait_for_checkpoint() is None  # nothing was pending: the save was synchronous
    else:
        acc.save_state(target)
        assert acc.wait_for_checkpoint() == target
    assert (tmp_path / "ckpt" / "COMPLETE").is_file()


SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from checkpoint_helpers import make_run, train
from impel.checkpoint.saving import staging

acc, model, opt, loader, sched = make_run({project!r})
train(acc, model, opt, loader, sched, 2)
real = staging.Deferred.run
def slow(self):
    time.sleep(1.0)  # the script has ended long before the files are written
    return real(self)
staging.Deferred.run = slow
print(acc.save_state(async_save=True), flush=True)
"""


def test_a_script_that_ends_right_after_an_async_save_leaves_a_complete_checkpoint(tmp_path):
    from impel.checkpoint.store import layout

    script = textwrap.dedent(SCRIPT.format(tests=str(TESTS), project=str(tmp_path)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    assert proc.stdout.strip() == str(checkpoint)
    assert layout.verify(checkpoint)["optimizer_steps"] == [2]
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["checkpoint_0"]


def test_async_save_under_deepspeed_raises_with_the_way_out():
    from types import SimpleNamespace

    from impel import ProjectConfiguration
    from impel.accelerator.save_load import Checkpointer
    from impel.config.run_config import ConfigError
    from impel.strategies.base import strategy_class

    engine = SimpleNamespace(engine_managed=strategy_class("DEEPSPEED").engine_managed)
    checkpointer = Checkpointer(ProjectConfiguration(), SimpleNamespace(strategy=engine))
    with pytest.raises(ConfigError, match=r"not supported under DeepSpeed .* save with async_save=False"):
        checkpointer._check_async()
