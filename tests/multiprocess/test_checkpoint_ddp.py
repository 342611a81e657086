"""Checkpoints on 2 DDP ranks: exact resume, rotation across a resume, one-rank misuse, a save killed midway."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from checkpoint_helpers import (
    assert_bitwise_equal,
    first_half,
    make_run,
    masking_run,
    resumed,
    train,
    uninterrupted,
)
from impel.testing import RankFailed, run_on_ranks

TIMEOUT = 120
# above the module fixture's three jobs: a hang is reported by run_on_ranks (with the ranks' stacks), not by
# pytest-timeout
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * TIMEOUT + 60)]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """20 uninterrupted steps; versus 10 steps saving at 4, 7, 10, then a new job that loads and saves at 15, 20."""
    project = str(tmp_path_factory.mktemp("ddp_resume"))
    reference = run_on_ranks(uninterrupted, 2, args=(20,), timeout=TIMEOUT)
    before = run_on_ranks(first_half, 2, args=(project, 10, [4, 7, 10], 2), timeout=TIMEOUT)
    after = run_on_ranks(resumed, 2, args=(project, 20, [15, 20], 2), timeout=TIMEOUT)
    return reference, before, after


def test_ddp_resume_is_bitwise_equal_to_the_uninterrupted_run(resume_runs):
    reference, _, after = resume_runs
    for rank in range(2):
        assert after[rank]["loaded"].endswith("checkpoint_2")  # the newest complete one, saved at step 10
        assert_bitwise_equal(after[rank], reference[rank])


def test_total_limit_two_keeps_the_two_newest_across_a_resume(resume_runs):
    _, before, after = resume_runs
    assert before[0] == ["checkpoint_1", "checkpoint_2"]
    assert after[0]["iteration"] == 3  # restored by load_state: the next save is checkpoint_3
    assert after[0]["listing"] == ["checkpoint_3", "checkpoint_4"]


def _save_on_rank_zero_only(project: str) -> str | None:
    acc, _model, _opt, _loader, _sched = make_run(project)  # the default process-group timeout for the whole job
    if not acc.is_main_process:
        return None  # rank 1 goes on without calling save_state
    # Only the wait for the absent rank is short: save_state's check-in waits for the process-group timeout, which
    # ProcessState holds (InitProcessGroupKwargs(timeout=...) sets it for the whole job, rendezvous included).
    acc.state.timeout = timedelta(seconds=2)
    try:
        acc.save_state()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_save_state_on_one_rank_only_raises_instead_of_hanging(tmp_path):
    message, _ = run_on_ranks(_save_on_rank_zero_only, 2, args=(str(tmp_path),), timeout=90)
    assert message.startswith("CheckpointError")
    assert "rank(s) [1] did not call it within 0:00:02" in message and "call it on every rank" in message
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists()


def _train_then_die_while_saving(project: str, snapshot_file: str, async_save: bool) -> None:
    import signal

    from impel.checkpoint.io import files

    acc, model, opt, loader, sched = make_run(project)
    train(acc, model, opt, loader, sched, 3, save_at=[3])
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), snapshot_file)
    train(acc, model, opt, loader, sched, 5)
    real_write = files._write_torch

    def write_half_then_die(session, obj, path):
        real_write(session, obj, path)  # async_save: the recorded write, on the background thread
        if path.name.startswith("random_states"):  # after rank 0 wrote model, optimizer and the rest
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

    files._write_torch = write_half_then_die
    acc.save_state(async_save=async_save)
    train(acc, model, opt, loader, sched, 7)  # async_save: training goes on while the background write dies
    acc.wait_for_checkpoint()


def _load_latest(project: str) -> tuple[str, dict[str, torch.Tensor], int]:
    acc, model, _opt, _loader, _sched = make_run(project, seed=99)
    loaded = acc.load_state()
    state = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return loaded, state, acc.save_iteration


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(async_save, tmp_path):
    project, snapshot_file = str(tmp_path), str(tmp_path / "at_step_3.pt")
    with pytest.raises(RankFailed, match="exited with code -9"):
        run_on_ranks(_train_then_die_while_saving, 2, args=(project, snapshot_file, async_save), timeout=TIMEOUT)
    partial = [p for p in (tmp_path / "checkpoints").iterdir() if p.name != "checkpoint_0"]
    assert len(partial) == 1 and partial[0].name.startswith(".impel-tmp-checkpoint_1")
    assert (partial[0] / "model.safetensors").exists()  # the kill came after real files were written
    results = run_on_ranks(_load_latest, 2, args=(project,), timeout=TIMEOUT)
    expected = torch.load(snapshot_file, weights_only=True)
    for loaded, state, iteration in results:
        assert loaded.endswith("checkpoint_0") and iteration == 1
        assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0"]  # partial one cleaned


def test_a_collator_drawing_random_masks_resumes_exactly_on_each_rank(tmp_path):
    """Each rank's batch after the save was fetched before it, drawing masks from that rank's RNG: each rank's
    state then is saved with its RNG states, so both ranks see the uninterrupted run's batches and end on its
    weights."""
    full = run_on_ranks(masking_run, 2, args=(str(tmp_path), "full"), timeout=TIMEOUT)
    again = run_on_ranks(masking_run, 2, args=(str(tmp_path), "position"), timeout=TIMEOUT)
    assert full[0][0][3:] != full[1][0][3:]  # the ranks' batches differ: a state saved once would not do
    for rank in range(2):
        assert again[rank][0] == full[rank][0][3:]
        assert again[rank][1] == full[rank][1]
