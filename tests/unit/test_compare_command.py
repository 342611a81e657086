"""``impel compare``: runs aligned on the step or on samples seen, relative differences, tolerance, plot."""
from __future__ import annotations

import json

import pytest

from impel.commands.main import main


def write_run(path, losses, samples_per_step=None, eval_losses=(), eval_accuracy=None, logging_steps=1):
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"step": (i + 1) * logging_steps, "loss": v} for i, v in enumerate(losses)]
    for step, value in eval_losses:
        rows.append({"step": step, "eval_loss": value, **({"eval_accuracy": eval_accuracy} if eval_accuracy else {})})
    if samples_per_step is not None:
        steps = len(losses) * logging_steps
        rows.append({"step": steps, "train_runtime": 2.0, "train_samples_per_second": steps * samples_per_step / 2.0,
                     "train_steps_per_second": steps / 2.0, "train_loss": sum(losses) / len(losses)})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(capsys, *args):
    code = main(["compare", *map(str, args)])
    return code, capsys.readouterr().out


def table_of(capsys, *args):
    code, out = run(capsys, *args, "--json", "--no_plot")
    return code, json.loads(out[: out.rindex("]") + 1])


def test_identical_runs_differ_by_nothing_and_pass_any_tolerance(tmp_path, capsys):
    a = write_run(tmp_path / "a", [2.0, 1.5, 1.2, 1.0], 8, eval_losses=[(4, 1.1)], eval_accuracy=0.5)
    b = write_run(tmp_path / "b", [2.0, 1.5, 1.2, 1.0], 8, eval_losses=[(4, 1.1)], eval_accuracy=0.5)
    code, table = table_of(capsys, a, b, "--tolerance", "0")
    assert code == 0
    assert table[1]["train_points"] == 4 and table[1]["train_mean_rel"] == 0 and table[1]["eval_mean_rel"] == 0
    assert table[1]["eval"] == {"eval_loss": 1.1, "eval_accuracy": 0.5}


def test_a_known_difference_is_measured_and_the_tolerance_decides_the_exit_code(tmp_path, capsys):
    base = [2.0, 1.6, 1.25, 1.0]
    a = write_run(tmp_path / "a", base)
    b = write_run(tmp_path / "b", [v * 1.1 for v in base[:2]] + [v * 1.3 for v in base[2:]])
    _, table = table_of(capsys, a, b)
    assert table[1]["train_mean_rel"] == pytest.approx(0.2) and table[1]["train_max_rel"] == pytest.approx(0.3)
    code, out = run(capsys, a, b, "--tolerance", "0.15", "--no_plot")
    assert code == 1 and "train loss differs from a by 20.00% on average (tolerance 15.00%)" in out
    assert run(capsys, a, b, "--tolerance", "0.25", "--no_plot")[0] == 0


def test_runs_with_different_batches_agree_when_aligned_on_samples(tmp_path, capsys):
    loss_at = lambda samples: 3.0 - samples / 100  # noqa: E731 - the same curve over samples seen
    small = write_run(tmp_path / "one_process", [loss_at(16 * s) for s in range(1, 9)], samples_per_step=16)
    big = write_run(tmp_path / "fsdp", [loss_at(32 * s) for s in range(1, 5)], samples_per_step=32)
    _, by_samples = table_of(capsys, small, big, "--align", "samples")
    assert by_samples[1]["train_points"] == 7  # the baseline's points inside the other run's range (32..128)
    assert by_samples[1]["train_mean_rel"] == pytest.approx(0, abs=1e-12)
    _, by_step = table_of(capsys, small, big)
    assert by_step[1]["train_mean_rel"] > 0.05  # step 3 of one is not step 3 of the other


def test_samples_per_step_can_be_given_and_is_required_without_a_trainer_summary(tmp_path, capsys):
    a = write_run(tmp_path / "a", [2.0, 1.8, 1.6, 1.4])
    b = write_run(tmp_path / "b", [1.8, 1.4])  # 16 samples per step: at 16 and 32 samples, as a's
    assert main(["compare", str(a), str(b), "--align", "samples", "--no_plot"]) == 2
    assert "pass --samples_per_step per run" in capsys.readouterr().err
    _, table = table_of(capsys, a, b, "--align", "samples", "--samples_per_step", "8", "--samples_per_step", "16")
    assert table[1]["train_points"] == 3 and table[1]["train_mean_rel"] == pytest.approx(0)  # 16, 24 (between), 32


def test_inputs_are_files_or_directories_and_mistakes_are_named(tmp_path, capsys):
    a = write_run(tmp_path / "a", [2.0, 1.0])
    nested = write_run(tmp_path / "b" / "inner", [2.0, 1.0])
    code, table = table_of(capsys, a / "metrics.jsonl", tmp_path / "b", "--name", "x", "--name", "y")
    assert code == 0 and [r["run"] for r in table] == ["x", "y"] and table[1]["file"] == str(nested / "metrics.jsonl")
    for args, message in [((a,), "at least two runs"), ((a, tmp_path / "missing"), "does not exist"),
                          ((a, a, "--name", "x"), "--name was given 1 time(s) for 2 runs"),
                          ((a, a, "--tolerance", "-1"), "must be >= 0")]:
        code = main(["compare", *map(str, args), "--no_plot"])
        assert code == 2 and message in capsys.readouterr().err


def test_runs_with_no_common_point_raise_instead_of_passing(tmp_path, capsys):
    a = write_run(tmp_path / "a", [2.0, 1.0])
    b = write_run(tmp_path / "b", [2.0, 1.0], logging_steps=5)  # steps 5 and 10
    code = main(["compare", str(a), str(b), "--tolerance", "0.1", "--no_plot"])
    assert code == 2 and "share no optimizer steps" in capsys.readouterr().err


def test_the_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path / "a", [2.0, 1.5, 1.2], 8, eval_losses=[(3, 1.3)])
    b = write_run(tmp_path / "b", [2.1, 1.4, 1.1], 8, eval_losses=[(3, 1.2)])
    picture = tmp_path / "curves.png"
    code, out = run(capsys, a, b, "--plot", picture)
    assert code == 0 and picture.stat().st_size > 10_000 and picture.read_bytes()[:4] == b"\x89PNG"
    assert "train mean rel" in out and f"curves: {picture}" in out


def test_rows_that_share_a_step_are_named_not_merged_silently(tmp_path, capsys):
    a = write_run(tmp_path / "a", [2.0, 1.5, 1.2, 1.0])
    b = tmp_path / "b"
    b.mkdir()  # a loop that never steps the optimizer: every row at step 0
    (b / "metrics.jsonl").write_text("".join(json.dumps({"step": 0, "loss": v}) + "\n" for v in (2.0, 1.9, 1.8)))
    assert main(["compare", str(a), str(b), "--json", "--no_plot"]) == 2  # and then: no step in common
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"impel compare: note: run 'b' ({b / 'metrics.jsonl'}) logs 'loss' more than once at a "
                      "step (step 0: 3 rows); only the last row of each step is compared. A resumed run rewrites "
                      "its history this way; a loop that logs without stepping the optimizer logs every row at one "
                      "step: pass log(..., step=N) a step that grows")
    assert err[1].startswith("impel compare: error: the runs share no optimizer steps")
    main(["compare", str(a), str(a), "--json", "--no_plot"])
    assert capsys.readouterr().err == ""  # distinct steps: no note
