"""Rows of docs/reliability.md for issue 27's round-2 inputs that ``reliability_cases`` runs: config validation,
storage failures during ``save_state``, API misuse and the tools. Each row is the exact message; the checkpoint rows
also check that nothing was lost (the previous checkpoint still loads, no temporary directory is left)."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import warnings
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bad_inputs import BAD_DEEPSPEED_JSON, DS_YAML

Row = tuple[str, str, str]


def _stderr(argv: list[str], expected: int) -> str:
    from impel.commands.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    assert code == expected, f"{argv} exited {code}: {err.getvalue()}"
    return err.getvalue().strip().splitlines()[0]


def deepspeed_json_rows(work: Path) -> list[Row]:
    """``config validate`` and ``config convert`` give the same one line for each bad DeepSpeed JSON."""
    (work / "ds.yaml").write_text(DS_YAML)
    rows: list[Row] = []
    for name in sorted(BAD_DEEPSPEED_JSON):
        text, _ = BAD_DEEPSPEED_JSON[name]
        (work / "ds.json").unlink(missing_ok=True)
        if text is not None:
            (work / "ds.json").write_text(text)
        validate = _stderr(["config", "validate", "ds.yaml"], 2)
        assert _stderr(["config", "convert", "--to", "fsdp", "ds.yaml"], 2) == validate
        what = "no ds.json" if text is None else f"ds.json: `{text}`"
        rows.append(("config file", "`impel config validate ds.yaml` (or `config convert`) of a DeepSpeed config "
                                    f"(2 processes, gradient_accumulation_steps: 4, deepspeed_config_file: ds.json), "
                                    f"{what}", validate))
    (work / "ds.json").unlink(missing_ok=True)
    return rows


def _accelerator(**kwargs: Any) -> Any:
    from impel import Accelerator
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    return Accelerator(cpu=True, **kwargs)


def _model_run() -> tuple[Any, nn.Module]:
    acc = _accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    return acc, model


def _failed_save(acc: Any, target: Path, patch: Any, asynchronous: bool = False) -> str:
    """The save's error with ``patch`` active, after checking nothing was lost: the previous checkpoint at
    ``target`` still loads and is the only entry of its directory."""
    try:
        with patch:
            acc.save_state(str(target), async_save=asynchronous)
            acc.wait_for_checkpoint()
    except Exception as exc:  # noqa: BLE001 - the message is what the table shows
        message = f"{type(exc).__name__}: {exc}"
    else:
        raise AssertionError("no error was raised")
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name], list(target.parent.iterdir())
    acc.load_state(str(target))
    return message


def checkpoint_rows(work: Path) -> list[Row]:
    from impel.checkpoint.io import direct_io
    from impel.checkpoint.store import storage

    acc, model = _model_run()
    root = work / "storage"
    target = root / "ckpt"
    acc.save_state(str(target))
    usage = namedtuple("usage", "total used free")
    full = mock.patch.object(storage.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 100, 100))

    def read_only(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    rows = [("checkpoint", "`save_state(ckpt)` (a second save) with 100 bytes free on the filesystem",
             _failed_save(acc, target, full)),
            ("checkpoint", "the same with `async_save=True`", _failed_save(acc, target, full, asynchronous=True)),
            ("checkpoint", "`save_state(ckpt)` on a filesystem that turned read-only (the write raises EROFS)",
             _failed_save(acc, target, mock.patch.object(direct_io, "open_direct", read_only)))]
    weights = target / "model.safetensors"
    rows.append(("checkpoint", "`load_state(\".../ckpt/model.safetensors\")` (a file, not the directory)",
                 _raises(lambda: acc.load_state(str(weights)))))
    bare = _accelerator()
    rows.append(("Accelerator", "`save_state()` before `prepare()`", _raises(lambda: bare.save_state(str(work / "x")))))
    assert not (work / "x").exists()
    return rows


def _raises(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the table shows
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("no error was raised")


def misuse_rows() -> list[Row]:
    acc = _accelerator(mixed_precision="fp16")
    model = nn.Linear(3, 1)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    rows = [("Accelerator", "`clip_grad_norm_` under fp16 before any `backward`",
             f"no error: returns {norm!r}, as Accelerate (torch's GradScaler used to assert)")]
    loader = acc.prepare(DataLoader(TensorDataset(torch.zeros(1, 2)), batch_size=4, drop_last=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(loader) == []
    rows.append(("data", "a prepared `DataLoader` of 1 sample, `batch_size=4, drop_last=True` (no batch at all)",
                 f"UserWarning: {caught[0].message}"))
    return rows


def tool_rows(work: Path) -> list[Row]:
    rows = [("tools", "`impel estimate-memory \"LlamaConfig(hidden_size=-5)\"`",
             _stderr(["estimate-memory", "LlamaConfig(hidden_size=-5)"], 2))]
    for name in ("a", "b"):
        (work / name).mkdir()
        (work / name / "metrics.jsonl").write_text("".join(json.dumps({"step": 0, "loss": v}) + "\n"
                                                           for v in (2.0, 1.9, 1.8)))
    rows.append(("tools", "`impel compare a b` of runs whose rows all sit at step 0 (a loop that never steps)",
                 _stderr(["compare", str(work / "a"), str(work / "b"), "--no_plot"], 0)))
    return rows


def round2_rows(work: Path) -> list[Row]:
    return deepspeed_json_rows(work) + checkpoint_rows(work) + misuse_rows() + tool_rows(work)
