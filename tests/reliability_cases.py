"""Every bad input impel was tried with, and the error it shows: the source of docs/reliability.md.

``collect(workdir)`` runs each case in this process (no ranks are started: every case fails before that) and
returns rows of (area, input, error). ``render(rows)`` is the markdown table. The unit test
``test_reliability_doc.py`` checks that the file matches; ``IMPEL_UPDATE_DOCS=1`` rewrites it.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import torch
from torch import nn

import process_cases
from bad_inputs import BAD_FILES, BAD_FLAGS
from reliability_round2 import _raises, round2_rows
from reliability_round3_checkpoints import round3_checkpoint_rows
from reliability_round3_data import round3_data_rows
from reliability_round3_launch import round3_launch_rows

Row = tuple[str, str, str]


def _cli(argv: list[str]) -> str:
    from impel.commands.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse errors
            code = exc.code
    assert code == 2, f"{argv} exited {code}: {err.getvalue()}"
    return err.getvalue().strip().splitlines()[-1]


def _config_rows(work: Path) -> list[Row]:
    rows: list[Row] = []
    for name in sorted(BAD_FILES):
        text, _ = BAD_FILES[name]
        path = work / f"{name}.yaml"
        path.write_text(text)
        shown = text.strip().replace("\n", " / ")
        rows.append(("config file", f"`{shown}`", _cli(["launch", "--config_file", str(path), "train.py"])))
    rows.append(("config file", "`--config_file nowhere.yaml`",
                 _cli(["launch", "--config_file", str(work / "nowhere.yaml"), "train.py"])))
    rows += _variable_rows(work)
    for name in sorted(BAD_FLAGS):
        flags, _ = BAD_FLAGS[name]
        rows.append(("launch flags", f"`impel launch {' '.join(flags)} train.py`",
                     _cli(["launch", *flags, "train.py"])))
    (work / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    rows.append(("launch flags", "`--use_deepspeed --zero_stage 2 --deepspeed_config_file ds.json` (the JSON says "
                 "stage 3)", _cli(["launch", "--use_deepspeed", "--zero_stage", "2", "--deepspeed_config_file",
                                   str(work / "ds.json"), str(work / "ds.json")])))
    rows.append(("launch flags", "`impel launch missing_script.py`", _cli(["launch", "missing_script.py"])))
    rows.append(("launch flags", "`impel launch -m no_such_module`", _cli(["launch", "-m", "no_such_module"])))
    return rows


def _variable_rows(work: Path) -> list[Row]:
    """$IMPEL_CONFIG_FILE naming a directory or a missing file (impel config writes there; the others read)."""
    rows: list[Row] = []
    (work / "configs").mkdir()
    for shown, value, argv in (("a directory", work / "configs", ["launch", "train.py"]),
                               ("a missing file", work / "nowhere.yaml", ["launch", "train.py"]),
                               ("a directory", work / "configs", ["config", "default"])):
        os.environ["IMPEL_CONFIG_FILE"] = str(value)
        try:
            rows.append(("config file", f"`IMPEL_CONFIG_FILE` naming {shown}, `impel {' '.join(argv)}`", _cli(argv)))
        finally:
            del os.environ["IMPEL_CONFIG_FILE"]
    return rows


def _model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def _prepared(hidden: int):
    acc = _accelerator()
    model = _model(hidden)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc


def _accelerator():
    from impel import Accelerator
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    return Accelerator(cpu=True)


def _checkpoint_rows(work: Path) -> list[Row]:
    from impel import Accelerator

    acc = _prepared(8)
    ckpt = work / "ckpt"
    acc.save_state(str(ckpt))
    rows: list[Row] = []
    other = _prepared(16)
    rows.append(("checkpoint", "load a checkpoint of another model (hidden 8 into hidden 16)",
                 _raises(lambda: other.load_state(str(ckpt)))))
    weights = next(ckpt.glob("model*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[:-8] + b"corrupt!")
    again = _prepared(8)
    rows.append(("checkpoint", "a checkpoint file with flipped bytes", _raises(lambda: again.load_state(str(ckpt)))))
    weights.write_bytes(data[: len(data) // 2])
    rows.append(("checkpoint", "a truncated checkpoint file", _raises(lambda: again.load_state(str(ckpt)))))
    (ckpt / "COMPLETE").unlink(missing_ok=True)
    rows.append(("checkpoint", "a checkpoint directory without its completion marker (a crash during save)",
                 _raises(lambda: again.load_state(str(ckpt)))))
    rows.append(("checkpoint", "`load_state()` with no directory and no automatic naming",
                 _raises(lambda: again.load_state())))
    rows.append(("Accelerator", "`Accelerator(mixed_precision='fp32')`",
                 _raises(lambda: Accelerator(cpu=True, mixed_precision="fp32"))))
    rows.append(("Accelerator", "`Accelerator(nonfinite_loss='warn')`",
                 _raises(lambda: Accelerator(cpu=True, nonfinite_loss="warn"))))
    return rows


_ISOLATED = ("IMPEL_CONFIG_FILE", "XDG_CACHE_HOME", "HF_HOME")


def collect(work: Path) -> list[Row]:
    old = {name: os.environ.get(name) for name in _ISOLATED}
    os.environ.pop("IMPEL_CONFIG_FILE", None)  # no user config: empty cache homes
    os.environ.update(XDG_CACHE_HOME=str(work / "cache"), HF_HOME=str(work / "cache" / "huggingface"))
    cwd = os.getcwd()
    os.chdir(work)
    try:
        return (_config_rows(work) + _checkpoint_rows(work) + round2_rows(work)
                + process_cases.rows(work, _cli, _raises, _prepared)
                + round3_launch_rows(work, _cli, _raises, _prepared)
                + round3_checkpoint_rows(work, _raises, _prepared) + round3_data_rows())
    finally:
        os.chdir(cwd)
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def render(rows: list[Row], work: Path) -> str:
    def clean(text: str) -> str:
        text = text.replace(str(work), "&lt;dir&gt;").replace("|", "\\|")
        return re.sub(r"(sha256|xxh3_128) [0-9a-f]{6,}\.*", r"\1 …", text)

    lines = ["# What impel does with bad input", "",
             "Generated from `tests/reliability_cases.py` (the unit test `tests/unit/test_reliability_doc.py` fails "
             "when this file is out of date; `IMPEL_UPDATE_DOCS=1 make test` rewrites it). Every case fails before "
             "any process starts or any file is written (or, where the row says so, keeps the user's files); the "
             "CLI's errors exit with code 2 and no traceback. A failed `save_state` leaves the previous checkpoint "
             "loadable and no temporary directory (the rows check it). The rows of area *ranks* start real ranks: "
             "`tests/process_cases.py` lists them with the line their test requires, the limit the test gives the "
             "launch, and the test checks that no rank is left running. Rows that are not errors show what happens "
             "instead.", "",
             "Crashes are covered by tests rather than rows: a rank killed with SIGKILL "
             "(`tests/cli/test_dead_rank.py`, "
             "`tests/cli/test_fault_tolerance.py`), SIGTERM (preemption, exit code 75), a save killed halfway "
             "(`tests/multiprocess/test_checkpoint_ddp.py`), a malicious pickle in a checkpoint "
             "(`tests/unit/test_checkpoint_safety.py`), `save_state` called on one rank only, and NaN/inf losses "
             "(`tests/multiprocess/test_nonfinite_ranks.py`), and a machine of an elastic job (`--nnodes 1:2`) "
             "killed with its ranks, which the job survives on the other machine with the same global batch and "
             "results, or machine 0, which hosts the rendezvous: the other stops in seconds with one line naming it "
             "(`tests/cli/test_elastic.py`).", "",
             "| area | input | error shown |", "|---|---|---|"]
    lines += [f"| {area} | {clean(what)} | {clean(error)} |" for area, what, error in rows]
    return "\n".join(lines) + "\n"
