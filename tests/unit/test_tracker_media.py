"""Images, tables, figures and artifacts through the trackers, as Accelerate's trackers write them: the same calls go
to impel's and to Accelerate's tracker classes, and what each wrote is read back with the tracker's own reader."""
from __future__ import annotations

import numpy as np
import pytest

from tracker_readers import read_wandb

IMAGES = {"samples": np.stack([np.full((3, 4, 5), i * 40, dtype=np.uint8) for i in range(3)])}  # NCHW


def _trackers(name: str):
    import accelerate.tracking as theirs

    import impel.trackers.builtin as ours

    return {"impel": getattr(ours, name), "accelerate": getattr(theirs, name)}


@pytest.fixture(autouse=True)
def _one_accelerate_process():
    from accelerate.state import PartialState

    PartialState()  # Accelerate's on_main_process asks it
    yield


def test_tensorboard_images_are_accelerate_s(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    written = {}
    for framework, cls in _trackers("TensorBoardTracker").items():
        tracker = cls("run", tmp_path / framework)
        tracker.start()
        tracker.log_images(IMAGES, step=3)
        tracker.log_images({"hwc": IMAGES["samples"].transpose(0, 2, 3, 1)}, step=4, dataformats="NHWC")
        tracker.finish()
        events = EventAccumulator(str(tmp_path / framework / "run"), size_guidance={"images": 0})
        events.Reload()
        written[framework] = {tag: [(e.step, e.width, e.height, e.encoded_image_string) for e in events.Images(tag)]
                              for tag in events.Tags()["images"]}
    assert sorted(written["impel"]) == ["hwc", "samples"]
    assert [e[:3] for e in written["impel"]["samples"]] == [(3, 15, 4)]  # add_images tiles the 3 images in a row
    assert written["impel"] == written["accelerate"]


def _wandb_media(framework: str, root: str) -> None:
    """On a rank of its own: W&B's service finishes writing the offline run file when the process ends."""
    from accelerate.state import PartialState

    PartialState()
    tracker = _trackers("WandBTracker")[framework]("media", dir=root)
    tracker.start()
    tracker.log_images({"samples": list(IMAGES["samples"].transpose(0, 2, 3, 1))}, step=1)
    tracker.log_table("preds", columns=["text", "label"], data=[["a", 0], ["b", 1]], step=2)
    tracker.finish()


def test_wandb_images_and_tables_are_accelerate_s(tmp_path):
    pytest.importorskip("wandb")
    from impel.testing import run_on_ranks

    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}
    rows = {}
    for framework in ("impel", "accelerate"):
        (tmp_path / framework).mkdir()
        run_on_ranks(_wandb_media, 1, args=(framework, str(tmp_path / framework)), env=env, timeout=120)
        (run,) = read_wandb(tmp_path / framework)
        # W&B flattens media values into dotted keys; its artifact paths are random, the rest is the content's
        kept = ("_step", "_type", "width", "height", "count", "ncols", "nrows", "sha256", "size", "format")
        rows[framework] = [{k: v for k, v in row.items() if k.rsplit(".", 1)[-1] in kept} for row in run["history"]]
    assert rows["impel"] == rows["accelerate"]
    images = next(r for r in rows["impel"] if "samples._type" in r)
    table = next(r for r in rows["impel"] if "preds._type" in r)
    assert (images["samples._type"], images["samples.count"], images["samples.width"], images["samples.height"],
            images["_step"]) == ("images/separated", 3, 5, 4, 1)
    assert (table["preds._type"], table["preds.ncols"], table["preds.nrows"], table["_step"]) == ("table-file", 2, 2, 2)


def test_mlflow_figures_and_artifacts_are_accelerate_s(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    uri = f"file://{tmp_path}/mlruns"
    for key, value in {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true",
                       "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}.items():
        monkeypatch.setenv(key, value)
    extra = tmp_path / "extra"
    (extra / "sub").mkdir(parents=True)
    (extra / "notes.txt").write_text("notes")
    (extra / "sub" / "table.csv").write_text("a,b\n1,2\n")
    client, listed = MlflowClient(uri), {}
    for framework, cls in _trackers("MLflowTracker").items():
        tracker = cls(f"exp_{framework}", logging_dir=str(tmp_path / f"artifacts_{framework}"))
        tracker.start()
        figure, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        tracker.log_figure(figure, "plots/curve.png")
        plt.close(figure)
        tracker.log_artifacts(str(extra), artifact_path="extra")
        tracker.log_artifact(str(extra / "notes.txt"))
        run_id = tracker.tracker.info.run_id
        tracker.finish()

        def walk(path=None, run_id=run_id):
            for item in client.list_artifacts(run_id, path):
                yield from walk(item.path) if item.is_dir else [(item.path, item.file_size > 0)]

        listed[framework] = sorted(walk())
    assert listed["impel"] == listed["accelerate"] == [
        ("extra/notes.txt", True), ("extra/sub/table.csv", True), ("notes.txt", True), ("plots/curve.png", True)]
