"""Launcher cases that need running ranks (issue 27): lost ranks, hangs, orphans. Shared by
``tests/cli/test_launcher_processes.py``, which runs each one, and docs/reliability.md, which lists them
(``reliability_cases.render``).

Each entry: name -> (the input, the line the launch must print (a regular expression), the limit in seconds the
test gives the launch: a hang fails the test at that limit). Every test also checks that no rank is left running
afterwards.
"""
from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROCESS_CASES = {
    "launcher_sigkill": (
        "`kill -9` of `impel launch` while its 2 ranks train",
        r"(no line: the launcher is gone; both ranks are killed by the kernel with it \(parent-death signal\))",
        60),
    "rank_exits_early": (
        "rank 0 calls `sys.exit(0)` at step 3 while rank 1 trains",
        r"impel launch: rank 0 left first, by its script ending \(it returned or called sys\.exit\(\)\), while the "
        r"other ranks were still running \(every rank must reach the same collectives\); rank 1 then failed with "
        r"exit code 1 \(its output is above\); the job stopped",
        150),
    "rank_stalls": (
        "rank 1 sleeps 12 s at step 3 while rank 0 waits in the all-reduce (`--stall_warning 2`)",
        r"impel watchdog: rank 0 has waited \d+ s in backward #4 for rank 1 \(outside impel's collectives for \d+ s "
        r"since backward #3: busy or stuck in the script's own code\); the process-group timeout \(600 s\) stops "
        r"the job if nothing moves \(IMPEL_STALL_WARNING / impel launch --stall_warning sets when this is printed\)",
        150),
}


def rows(work: Path, cli: Callable[[list[str]], str], raises: Callable[[Callable[[], object]], str],
         prepared: Callable[[int], Any]) -> list[tuple[str, str, str]]:
    """docs/reliability.md's rows of issue 27 (``reliability_cases.collect``): the one-process cases run here;
    :data:`PROCESS_CASES` are listed with the line their test requires (``\\d+`` shown as N)."""
    out = _rendezvous_rows(work, cli) + _checkpoint_rows(work, raises, prepared) + [_elastic_row(raises)]
    for what, line, limit in PROCESS_CASES.values():
        shown = re.sub(r"\\(.)", r"\1", line.replace(r"\d+", "N"))
        out.append((f"ranks (`tests/cli/test_launcher_processes.py`, {limit} s limit, no rank left)", what, shown))
    return out


def _rendezvous_rows(work: Path, cli: Callable[[list[str]], str]) -> list[tuple[str, str, str]]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        line = cli(["launch", "--cpu", "--num_processes", "2", "--main_process_port", port, "train.py"])
    (work / "port.yaml").write_text("main_process_port: 99999\n")
    (work / "elastic.yaml").write_text("num_machines: 2\nmin_machines: 1\nmain_process_ip: 10.0.0.1\n")
    return [("config file", "`impel config validate` of `num_machines: 2` / `min_machines: 1` (no max_restarts)",
             cli(["config", "validate", str(work / "elastic.yaml")])),
            ("launch flags", "`--main_process_port PORT` while another process listens on PORT",
             line.replace(port, "PORT")),
            ("config file", "`impel config validate` of `main_process_port: 99999`",
             cli(["config", "validate", str(work / "port.yaml")]))]


def _checkpoint_rows(work: Path, raises: Callable[[Callable[[], object]], str],
                     prepared: Callable[[int], Any]) -> list[tuple[str, str, str]]:
    from impel import merge_weights

    acc = prepared(8)
    ck = work / "ck"
    acc.save_state(str(ck))
    (ck / "eval").mkdir()
    (ck / "eval" / "results.json").write_text("{}")
    (ck / "notes.txt").write_text("mine")
    acc.save_state(str(ck))
    kept = (ck / "notes.txt").read_text() == "mine" and (ck / "eval" / "results.json").is_file()
    out = [("checkpoint", "`save_state(ck)` again, with `ck/notes.txt` and `ck/eval/results.json` written there",
            "no error: both files are kept (carried into the new checkpoint)" if kept else "LOST: files deleted")]
    out.append(("checkpoint", "`merge_weights(ck, ck/out)` (`impel merge-weights CK CK/out`)",
                raises(lambda: merge_weights(ck, ck / "out"))))
    model = acc.prepared.models[0]
    out.append(("checkpoint", "`save_model(model, ck/final)`", raises(lambda: acc.save_model(model, ck / "final"))))
    out.append(_rotation_row(work))
    (ck / "impel_checkpoint.json").write_text("{ truncated")
    out.append(("checkpoint", "`save_state(ck)` over a checkpoint whose `impel_checkpoint.json` is damaged",
                raises(lambda: acc.save_state(str(ck)))))
    return out


def _rotation_row(work: Path) -> tuple[str, str, str]:
    """``total_limit`` rotation keeps what the user wrote into the checkpoint it deletes."""
    import logging

    from impel import Accelerator, ProjectConfiguration
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    config = ProjectConfiguration(str(work / "rotate"), automatic_checkpoint_naming=True, total_limit=1)
    acc = Accelerator(cpu=True, project_config=config)
    model = acc.prepare(_tiny())
    oldest = Path(acc.save_state())
    (oldest / "notes.txt").write_text("mine")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("impel")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        acc.save_state()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert model is not None and (oldest / "notes.txt").read_text() == "mine", "LOST: notes.txt deleted"
    assert sorted(p.name for p in oldest.iterdir()) == ["notes.txt"]
    logged = next(line for line in lines if "kept the directory" in line)
    return ("checkpoint", "`ProjectConfiguration(total_limit=1)`: the next `save_state()` rotates `checkpoint_0`, "
                          "into which the user wrote `notes.txt`", f"no error: logs `{logged}`")


def _tiny() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def _elastic_row(raises: Callable[[Callable[[], object]], str]) -> tuple[str, str, str]:
    """A rank of an elastic job whose script does not resume from checkpoints."""
    import json
    import os

    from impel import Accelerator
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    launched = {"min_machines": 1, "num_machines": 2, "main_process_ip": "127.0.0.1", "use_cpu": True}
    os.environ["IMPEL_CONFIG"] = json.dumps(launched)
    try:
        line = raises(lambda: Accelerator())
    finally:
        del os.environ["IMPEL_CONFIG"]
        ProcessState._reset()
    return ("Accelerator", "`Accelerator()` in a rank of `impel launch --nnodes 1:2 ...` without `--auto_resume`",
            line)
