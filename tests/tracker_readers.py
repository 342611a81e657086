"""Read back what a tracker wrote, with the tracker's own reader, as plain comparable data.

TensorBoard: its ``EventAccumulator``; W&B: the offline run file (``run-*.wandb``, leveldb-log framed records of
W&B's own ``wandb_internal_pb2.Record`` protobuf; wandb 0.31 has no Python reader of its own left); MLflow: its
``MlflowClient`` on the file store; trackio: its ``SQLiteStorage``. NaN becomes the string "nan" so that results
compare with ``==``; timestamp-named directories become ``<time>``.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

STAMP = re.compile(r"^\d{9,}\.\d+$")  # the time.time() directories TensorBoard's add_hparams and Accelerate make


def comparable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    return value


def read_tensorboard(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """{"layout": sorted (directory, kind) pairs, "scalars": {dir/tag: [(step, value, wall_time)]},
    "text": {tag: [(step, text)]}, "hparams": {dir: hparams.yml contents}, "suffixes": event file suffixes}."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(run_dir)
    out: dict[str, Any] = {"layout": set(), "scalars": {}, "text": {}, "hparams": {}, "hparam_keys": {},
                           "suffixes": set()}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = "/".join("<time>" if STAMP.match(p) else p for p in path.parent.relative_to(root.parent).parts)
        if path.name.startswith("events.out.tfevents."):
            out["layout"].add((rel, "events"))
            out["suffixes"].add(path.name.rsplit(".", 1)[-1] if not path.name.split(".")[-1].isdigit() else "")
            acc = EventAccumulator(str(path))
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                out["scalars"][f"{rel}/{tag}"] = [(e.step, comparable(e.value), e.wall_time) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["tensors"]:
                out["text"][tag] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            try:
                hp = acc.PluginTagToContent("hparams")
            except KeyError:
                hp = {}
            if "_hparams_/session_start_info" in hp:
                from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

                data = HParamsPluginData.FromString(hp["_hparams_/session_start_info"])
                out["hparam_keys"][rel] = {k: v.WhichOneof("kind") for k, v in
                                           data.session_start_info.hparams.items()}
        elif path.name == "hparams.yml":
            out["layout"].add((rel, "hparams.yml"))
            out["hparams"][rel] = yaml.safe_load(path.read_text())
        else:
            out["layout"].add((rel, path.name))
    out["layout"] = sorted(out["layout"])
    out["suffixes"] = sorted(out["suffixes"])
    return out


def _wandb_records(path: Path) -> list[Any]:
    """W&B's transaction log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of leveldb-log chunks
    (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) whose payloads are serialized ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
            pending = b""
    return records


def read_wandb(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One dict per offline run under ``root``/wandb: project, name, tags, config, history rows (W&B's own
    ``_timestamp`` / ``_runtime`` left out)."""
    runs = []
    for run_file in sorted(Path(root).glob("wandb/offline-run-*/run-*.wandb")):
        run: dict[str, Any] = {"project": None, "name": None, "tags": [], "config": {}, "history": []}
        for record in _wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(project=record.run.project, name=record.run.display_name, tags=list(record.run.tags))
                run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                row = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                run["history"].append(comparable({k: v for k, v in row.items() if k not in ("_timestamp", "_runtime")}))
        run["config"].pop("_wandb", None)
        runs.append(run)
    return runs


def read_mlflow(tracking_uri: str) -> dict[str, Any]:
    """{experiment name: [one dict per run: name, tags (user's), params, metrics {key: [(step, value, timestamp)]},
    artifact_location]}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    out: dict[str, Any] = {}
    for exp in client.search_experiments():
        runs = []
        for run in client.search_runs([exp.experiment_id]):
            metrics = {key: sorted((m.step, comparable(m.value), m.timestamp)
                                   for m in client.get_metric_history(run.info.run_id, key))
                       for key in run.data.metrics}
            runs.append({"name": run.info.run_name, "params": run.data.params, "metrics": metrics,
                         "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
                         "description": run.data.tags.get("mlflow.note.content"),
                         "artifact_location": exp.artifact_location})
        if runs:
            out[exp.name] = runs
    return out


def read_trackio(project: str) -> dict[str, Any]:
    """{run name: {"logs": rows without timestamps, "config": the user's keys}} of a trackio project (in
    ``$TRACKIO_DIR``)."""
    from trackio.sqlite_storage import SQLiteStorage

    out = {}
    for name in SQLiteStorage.get_runs(project):
        logs = [comparable({k: v for k, v in row.items() if k != "timestamp"})
                for row in SQLiteStorage.get_logs(project, name)]
        config = {k: v for k, v in (SQLiteStorage.get_run_config(project, name) or {}).items()
                  if not k.startswith("_")}
        out[name] = {"logs": logs, "config": config}
    return out
