"""TensorBoard, W&B, MLflow and trackio through the Accelerator, written for real (offline) and read back with each
tracker's own reader, compared with what Accelerate 1.15 writes for the same calls; on 1 process and 2 CPU ranks.

One script logs to all four at once (``log_with=[...]``, ``init_kwargs`` and ``log_kwargs`` for each). W&B runs
with ``WANDB_MODE=offline`` in ``$WANDB_DIR``, MLflow on a file store (``$MLFLOW_TRACKING_URI``), trackio in
``$TRACKIO_DIR``, TensorBoard in ``project_dir``; each framework gets its own directories.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import numpy as np
import pytest

from impel.testing import run_on_ranks
from tracker_readers import read_mlflow, read_tensorboard, read_trackio, read_wandb

pytestmark = pytest.mark.multiprocess
# find_spec, not importorskip: trackio reads $TRACKIO_DIR when imported, and the ranks import this module
_missing = [p for p in ("accelerate", "tensorboard", "wandb", "mlflow", "trackio") if not importlib.util.find_spec(p)]
if _missing:
    pytest.skip(f"not installed: {', '.join(_missing)} (make venv installs them)", allow_module_level=True)

NAMES = ["tensorboard", "wandb", "mlflow", "trackio"]
CONFIG = {"lr": 0.1, "layers": 2, "optimizer": "adamw", "fp16": False}
INIT_KWARGS = {"tensorboard": {"filename_suffix": ".first"},
               "wandb": {"name": "first", "tags": ["cpu", "tiny"]},
               "mlflow": {"run_name": "first", "tags": {"team": "impel"}, "description": "a tiny run"},
               "trackio": {"name": "first"}}
WALLTIME, MLFLOW_TIME = 1_700_000_000.0, 1_700_000_000_000
ODD = {"note": "text", "nan": float("nan"), "pair": {"a": 1.0, "b": 2.0}, "tokens": [1, 2],
       "hist": np.linspace(0.0, 1.0, 40)}  # W&B makes a histogram of a long array: it gets values as they are


def _environment(root: str) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_DIR": root, "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
            "WANDB_CACHE_DIR": os.path.join(root, "wandb-cache"),
            "WANDB_CONFIG_DIR": os.path.join(root, "wandb-config"),
            "MLFLOW_TRACKING_URI": f"file://{root}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true",
            "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
            "TRACKIO_DIR": os.path.join(root, "trackio"), "ACCELERATE_USE_CPU": "1"}


def _script(framework: str, root: str) -> dict:
    """What a user's script does; returns this rank's active trackers and the warnings impel logged."""
    import torch

    if framework == "accelerate":
        from accelerate import Accelerator
    else:
        from impel import Accelerator
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("impel.trackers.registry").addHandler(handler)
    acc = Accelerator(cpu=True, log_with=NAMES, project_dir=os.path.join(root, "logs"))
    acc.init_trackers("proj", config=CONFIG, init_kwargs=INIT_KWARGS)
    for step in range(3):
        acc.log({"loss": 1.0 / (step + 1), "acc": torch.tensor(0.5 + step / 4)}, step=step,
                log_kwargs={"tensorboard": {"walltime": WALLTIME + step}, "mlflow": {"timestamp": MLFLOW_TIME + step}})
    acc.log({"partial": 1.0}, step=3, log_kwargs={"wandb": {"commit": False}})  # W&B merges it with the next call
    acc.log(ODD, step=3)
    acc.log(ODD, step=4)  # a second time: no second warning
    active = [t.name for t in acc.trackers]
    acc.end_training()
    return {"active": active, "warnings": seen}


def _read(root: str) -> dict:
    env = _environment(root)
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        mlflow = read_mlflow(env["MLFLOW_TRACKING_URI"])
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]
    for runs in mlflow.values():
        for run in runs:
            run["artifact_location"] = run["artifact_location"].replace(root, "<root>").rsplit("/", 1)[0]
    (trackio,) = run_on_ranks(read_trackio, 1, args=("proj",), env={"TRACKIO_DIR": env["TRACKIO_DIR"]})
    return {"tensorboard": read_tensorboard(os.path.join(root, "logs", "proj")), "wandb": read_wandb(root),
            "mlflow": mlflow, "trackio": trackio}


def _untimed(wrote: dict) -> dict:
    """The read-back values without the wall-clock times that no two runs share."""
    out = dict(wrote)
    out["tensorboard"] = {**wrote["tensorboard"], "scalars": {
        k: [(s, v) for s, v, _ in points] for k, points in wrote["tensorboard"]["scalars"].items()}}
    out["mlflow"] = {name: [{**run, "metrics": {k: [(s, v) for s, v, _ in points]
                                                for k, points in run["metrics"].items()}} for run in runs]
                     for name, runs in wrote["mlflow"].items()}
    return out


def _run(framework: str, world: int, root: str) -> tuple[list[dict], dict]:
    results = run_on_ranks(_script, world, args=(framework, root), env=_environment(root), timeout=240)
    return results, _read(root)


@pytest.fixture(scope="module")
def accelerate_wrote(tmp_path_factory):
    """What Accelerate 1.15 writes for the script on one process (read back once for the module)."""
    return _run("accelerate", 1, str(tmp_path_factory.mktemp("accelerate")))


@pytest.fixture(scope="module")
def impel_wrote(tmp_path_factory):
    """What impel writes for the script on one process."""
    return _run("impel", 1, str(tmp_path_factory.mktemp("impel")))


LOSS = [1.0, 0.5, 1.0 / 3]
ACC = [0.5, 0.75, 1.0]


def _check_values(wrote: dict) -> None:
    """The values each tracker holds, stated outright (so a change both frameworks made would still fail)."""
    tb = wrote["tensorboard"]
    assert [(s, v) for s, v, _ in tb["scalars"]["proj/loss"]] == [(s, pytest.approx(LOSS[s])) for s in range(3)]
    assert [(s, v, w) for s, v, w in tb["scalars"]["proj/acc"]] == [(s, ACC[s], WALLTIME + s) for s in range(3)]
    assert [(s, v) for s, v, _ in tb["scalars"]["proj/nan"]] == [(3, "nan"), (4, "nan")]
    assert [(s, v) for s, v, _ in tb["scalars"]["proj/pair_b/pair"]] == [(3, 2.0), (4, 2.0)]
    assert tb["text"] == {"note/text_summary": [(3, "text"), (4, "text")]}
    assert tb["hparams"] == {"proj/<time>": CONFIG} and "first" in tb["suffixes"]  # init_kwargs reached it
    (run,) = wrote["wandb"]
    assert (run["project"], run["name"], run["tags"], run["config"]) == ("proj", "first", ["cpu", "tiny"], CONFIG)
    assert [(r["_step"], r["loss"], r["acc"]) for r in run["history"][:3]] == list(zip(range(3), LOSS, ACC))
    row = dict(run["history"][3])
    histogram = {k: row.pop(k) for k in list(row) if k.startswith("hist.")}
    assert histogram["hist._type"] == "histogram" and sum(histogram["hist.values"]) == 40
    assert row == {"_step": 3, "partial": 1, "note": "text", "nan": "nan", "pair.a": 1, "pair.b": 2,
                                 "tokens": [1, 2]}  # "partial" (commit=False) merged into the next call's row
    (mlrun,) = wrote["mlflow"]["proj"]
    assert (mlrun["name"], mlrun["tags"], mlrun["description"]) == ("first", {"team": "impel"}, "a tiny run")
    assert mlrun["params"] == {k: str(v) for k, v in CONFIG.items()}
    assert mlrun["metrics"]["loss"] == [(s, LOSS[s], MLFLOW_TIME + s) for s in range(3)]  # log_kwargs' timestamp
    assert [(s, v) for s, v, _ in mlrun["metrics"]["nan"]] == [(3, "nan"), (4, "nan")]
    (trackio,) = wrote["trackio"].values()
    assert [(r["step"], r["loss"]) for r in trackio["logs"][:3]] == list(zip(range(3), LOSS))
    # trackio stores strings, dicts and lists; it skips (with its own warning) an array it cannot serialise
    assert trackio["logs"][4] == {"step": 3, **{k: v for k, v in ODD.items() if k != "hist"}, "nan": "nan"}


def test_one_process_writes_what_accelerate_writes(impel_wrote, accelerate_wrote):
    (ours,), wrote = impel_wrote
    (theirs,), reference = accelerate_wrote
    assert ours["active"] == theirs["active"] == NAMES
    _check_values(wrote)
    _check_values(reference)
    mine, ref = _untimed(wrote), _untimed(reference)
    assert mine["tensorboard"] == ref["tensorboard"]  # same directories, files, scalars, text and hparams
    assert mine["wandb"] == ref["wandb"]
    # Accelerate hands a tensor to MLflow and trackio as it is: MLflow drops it (with a warning), trackio skips it;
    # impel logs its number. Everything else is equal.
    (ml_mine,), (ml_ref,) = mine["mlflow"]["proj"], ref["mlflow"]["proj"]
    assert "acc" not in ml_ref["metrics"] and ml_mine["metrics"]["acc"] == list(enumerate(ACC))
    assert {**ml_mine, "metrics": {k: v for k, v in ml_mine["metrics"].items() if k != "acc"}} == ml_ref
    (tr_mine,), (tr_ref,) = mine["trackio"].values(), ref["trackio"].values()
    assert [{k: v for k, v in row.items() if k != "acc"} for row in tr_mine["logs"]] == tr_ref["logs"]
    # Accelerate passes allow_val_change=True into trackio's config dict, which stores it as a key
    assert tr_mine["config"] == {k: v for k, v in tr_ref["config"].items() if k != "allow_val_change"} == CONFIG


def test_values_a_tracker_cannot_store_are_dropped_with_one_warning_naming_the_key(impel_wrote):
    (ours,), _ = impel_wrote
    dropped = sorted(tuple(w.split(" = ")[0].split(" did not log ")) for w in ours["warnings"] if " did not log " in w)
    assert dropped == [("MLflow", "'hist'"), ("MLflow", "'note'"), ("MLflow", "'pair'"), ("MLflow", "'tokens'"),
                       ("TensorBoard", "'hist'"), ("TensorBoard", "'tokens'")]


def test_two_ranks_write_one_run_from_the_main_process(tmp_path, accelerate_wrote):
    (rank0, rank1), wrote = _run("impel", 2, str(tmp_path))
    assert rank0["active"] == NAMES and rank1["active"] == [] and rank1["warnings"] == []
    _check_values(wrote)  # one run per tracker, holding exactly the one-process values
    _, reference = accelerate_wrote
    mine, ref = _untimed(wrote), _untimed(reference)
    assert mine["tensorboard"] == ref["tensorboard"] and mine["wandb"] == ref["wandb"]
