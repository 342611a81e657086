"""Accelerate-style training scripts give the same numbers under impel as under Accelerate 1.15, on 2 CPU ranks.

Each script in ``tests/compat_scripts/`` is written against Accelerate, as its examples and transformers'
``*_no_trainer.py`` scripts are. It runs twice: as written, under
``python -m torch.distributed.run --standalone --nproc_per_node 2`` with ``ACCELERATE_USE_CPU=1`` (without it,
Accelerate trains unsynchronised replicas on a CPU-only machine), and after
``re.sub(r"\\baccelerate\\b", "impel", source)`` under ``impel launch --cpu --num_processes 2``, the renamed form of
``accelerate launch``. Each run prints one ``COMPAT {json}`` line on the main process: the learning rate after every
optimizer step, the final parameters and the evaluation metrics. The two must agree: the same learning-rate trace
(exactly: the same scheduler steps), the final parameters within ``TOLERANCE`` and the same metrics.

The scripts, and what each one leans on:

- ``nlp_example.py``: tiny BERT with dropout, shuffled ``drop_last`` loader, AdamW, a warmup schedule sized from
  the unprepared loader, ``accumulate()`` over 2, ``DistributedType`` branches, ``gather_for_metrics`` truncation.
- ``clm_no_trainer.py``: tiny GPT-2, ``--max_train_steps`` sizing times ``num_processes``, ``save_state`` every 2
  steps, early stopping by one rank (``set_trigger`` / ``check_trigger``), then a second launch resuming from the
  latest checkpoint (in epoch 0) with ``load_state`` + ``skip_first_batches``, perplexity from ``loss.repeat``,
  ``accelerator.save``, ``find_executable_batch_size``. Dropout is off there: Accelerate's own resume is not exact
  with it (the resumed pass draws from the global RNG ``load_state`` restored), nor after epoch 0 (the sampler's
  generator is not saved); impel's resume is exact, a deliberate difference, so only this case can be compared.
- ``local_sgd_comm_hook.py``: LocalSGD, then hand-made accumulation with ``accelerator.no_sync`` / ``model.no_sync()``
  through DDP's fp16 compression hook, ``clip_grad_norm_``, ``reduce``.
- ``split_uneven_metrics.py``: ``split_batches``, 45 samples in global batches of 8 (a padded last batch),
  ``GradientAccumulationPlugin``, ``OneCycleLR``, gathering dicts and Python objects, ``even_batches = False`` with
  ``pad_across_processes``.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli_helpers import clean_env, finish, impel

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[1] / "compat_scripts"
TOLERANCE = 1e-5  # fp32: max |impel - Accelerate| over every final parameter, and relative for float metrics
LAUNCH_TIMEOUT = 150  # seconds for one 2-rank launch (15-40 s here, with the other framework's run alongside)


def _report(stdout: str, where: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("COMPAT ")]
    assert len(lines) == 1, f"{where}: expected one COMPAT line from the main process, got {len(lines)}"
    return json.loads(lines[0][len("COMPAT "):])


def run_accelerate(script: str, args: list[str], home: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPTS / script), *args]
    proc = subprocess.Popen(cmd, cwd=home, env=clean_env(home, ACCELERATE_USE_CPU="1"), text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    res = finish(proc, LAUNCH_TIMEOUT)
    assert res.returncode == 0, f"Accelerate's run of {script} failed:\n{res.output[-4000:]}"
    return _report(res.stdout, f"{script} under Accelerate")


def run_impel(script: str, args: list[str], home: Path) -> dict:
    source = (SCRIPTS / script).read_text()
    renamed = re.sub(r"\baccelerate\b", "impel", source)
    assert "accelerate" not in renamed and "from impel" in renamed
    path = home / f"impel_{script}"
    path.write_text(renamed)
    res = impel(["launch", "--cpu", "--num_processes", "2", str(path), *args], home, timeout=LAUNCH_TIMEOUT)
    assert res.returncode == 0, f"impel's run of the renamed {script} failed:\n{res.output[-4000:]}"
    return _report(res.stdout, f"renamed {script} under impel")


def _same_metrics(ours, theirs) -> bool:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(_same_metrics(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(_same_metrics(a, b) for a, b in zip(ours, theirs))
    if isinstance(ours, float) or isinstance(theirs, float):
        return math.isclose(ours, theirs, rel_tol=TOLERANCE, abs_tol=TOLERANCE)
    return ours == theirs


def compare(label: str, ours: dict, theirs: dict) -> None:
    """Same LR trace, final parameters within TOLERANCE, same metrics and the same everything else."""
    assert len(ours["params"]) == len(theirs["params"])
    worst = max(abs(a - b) for a, b in zip(ours["params"], theirs["params"]))
    same_lrs, same_metrics = ours["lrs"] == theirs["lrs"], _same_metrics(ours["metrics"], theirs["metrics"])
    print(f"{label}: LR trace of {len(theirs['lrs'])} optimizer steps {'equal' if same_lrs else 'DIFFERENT'}; "
          f"max |impel - accelerate| over {len(theirs['params'])} parameters = {worst:.3g} "
          f"(tolerance {TOLERANCE:g}); metrics {'equal' if same_metrics else 'DIFFERENT'}")
    assert same_lrs, f"{label}: learning-rate traces differ:\nimpel      {ours['lrs']}\naccelerate {theirs['lrs']}"
    assert worst <= TOLERANCE, f"{label}: final parameters differ by {worst:.3g}"
    assert same_metrics, f"{label}: metrics differ:\nimpel      {ours['metrics']}\naccelerate {theirs['metrics']}"
    rest = {k: v for k, v in ours.items() if k not in ("lrs", "params", "metrics")}
    assert rest == {k: v for k, v in theirs.items() if k not in ("lrs", "params", "metrics")}


def both(script: str, args: list[str], tmp_path: Path) -> tuple[dict, dict]:
    """(impel's report, Accelerate's); each framework runs in its own directory, kept between launches."""
    homes = {fw: tmp_path / fw for fw in ("accelerate", "impel")}
    for home in homes.values():
        home.mkdir(exist_ok=True)
    with ThreadPoolExecutor(2) as pool:  # side by side: a rank waiting on its peer leaves a core to the other job
        theirs = pool.submit(run_accelerate, script, args, homes["accelerate"])
        ours = pool.submit(run_impel, script, args, homes["impel"])
        return ours.result(), theirs.result()


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
def test_nlp_example(tmp_path):
    ours, theirs = both("nlp_example.py", [], tmp_path)
    compare("nlp_example", ours, theirs)
    # 48 samples, 2 ranks x 4, drop_last: 6 batches a rank, 3 optimizer steps an epoch; 30 eval samples, the last
    # global batch of 16 padded by 2 duplicates that gather_for_metrics drops
    assert len(theirs["lrs"]) == 9 and theirs["lrs"][-1] == 0.0  # the schedule ends with the training
    assert [m["samples"] for m in theirs["metrics"]] == [30, 30, 30]


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT + 30)
def test_clm_no_trainer_with_early_stop_and_resume(tmp_path):
    common = ["--output_dir", "out", "--max_train_steps", "8", "--checkpointing_steps", "2"]
    # the last rank stops everyone after step 3 (the end of epoch 0); the latest checkpoint is step_2
    ours, theirs = both("clm_no_trainer.py", [*common, "--stop_after_step", "3"], tmp_path)
    compare("clm_no_trainer (stopped early)", ours, theirs)
    assert theirs["batch_size"] == 4 and theirs["stopped_early"] and theirs["checkpoints"] == ["step_2"]
    assert len(theirs["lrs"]) == 3 and theirs["metrics"][-1]["eval_samples"] == 10
    # a second launch resumes from step_2 (load_state + skip_first_batches) and trains to max_train_steps
    ours, theirs = both("clm_no_trainer.py", [*common, "--resume_from_checkpoint", "latest"], tmp_path)
    compare("clm_no_trainer (resumed)", ours, theirs)
    assert not theirs["stopped_early"] and theirs["checkpoints"] == ["step_2", "step_4", "step_6", "step_8"]
    assert len(theirs["lrs"]) == 6 and theirs["lrs"][-1] == 0.0  # sized for max_train_steps * num_processes


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
def test_local_sgd_and_a_ddp_comm_hook(tmp_path):
    ours, theirs = both("local_sgd_comm_hook.py", [], tmp_path)
    compare("local_sgd_comm_hook", ours, theirs)
    assert len(theirs["lrs"]) == 2 * 4 + 2 * 2  # LocalSGD epochs: 4 steps; hand-accumulated epochs: 2


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
def test_split_batches_and_uneven_data(tmp_path):
    ours, theirs = both("split_uneven_metrics.py", [], tmp_path)
    compare("split_uneven_metrics", ours, theirs)
    assert theirs["batches_per_rank"] == [6, 6, 6] and len(theirs["lrs"]) == 9
    assert all(m["samples"] == 45 for m in theirs["metrics"])
    assert theirs["metrics"][-1]["same"] and theirs["metrics"][-1]["records"] == 45
