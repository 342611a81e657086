"""Rows of docs/reliability.md for issue 36's launcher, CLI and config inputs (round 3) that
``reliability_cases.collect`` runs in this process (none starts a rank), and the cases that need running ranks
(:data:`LAUNCH_CASES`, run by ``tests/cli/test_round3_launch.py``; listed here with the line their test requires).
The launch flags and DeepSpeed JSONs of this round are in ``bad_inputs.py`` (BAD_FLAGS, BAD_DEEPSPEED_JSON)."""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = tuple[str, str, str]

# name -> (the input, the line the launch must print (a regular expression), the limit in seconds of its test[, the
# test file when not tests/cli/test_round3_launch.py])
LAUNCH_CASES = {
    "rank_exits_with_code": (
        "rank 1 calls `sys.exit(3)` at step 3 while rank 0 trains",
        r"impel launch: rank 1 left first, by its script ending with exit code 3 \(sys\.exit\(3\)\), while the other "
        r"ranks were still running \(every rank must reach the same collectives\); rank 0 then failed with exit code "
        r"1 \(its output is above\); the job stopped",
        120),
    "machines_disagree_on_nnodes": (
        "two machines of an elastic job, `--gradient_accumulation_steps 6` on both, machine 0 `--nnodes 1:2`, "
        "machine 1 `--nnodes 1:3` (each would accumulate its own: 6 and 9)",
        r"ConfigError: the machines of this elastic job were launched with different settings: rank 0 --nnodes 1:2 "
        r"--gradient_accumulation_steps 6 \(accumulating 6\), rank 1 --nnodes 1:3 --gradient_accumulation_steps 6 "
        r"\(accumulating 9\); launch every machine with the same --nnodes and --gradient_accumulation_steps",
        180),
    "different_collectives": (
        "rank 0 calls `wait_for_everyone()` while rank 1 calls `gather(...)` at the same step (`--stall_warning 2`, "
        "group timeout 8 s)",
        r"impel watchdog: rank 0 has waited \d+ s in wait_for_everyone #4 for rank 1 \(in gather #4 at "
        r"collectives\.py:10, while this rank is in wait_for_everyone at collectives\.py:8: the two ranks are in "
        r"different collectives, which never meet; every rank must call the same collectives in the same order\)",
        120),
    "no_machine_0": (
        "machine 1 of an elastic job (`--nnodes 1:2 --machine_rank 1`, `--rdzv_conf join_timeout=6`) started with "
        "no machine 0",
        r"impel launch: machine 0 never answered at 127\.0\.0\.1:\d+ in 6 s \(Connection refused\); it hosts the "
        r"rendezvous: start machine 0 \(--machine_rank 0\) with the same --main_process_ip and --main_process_port, "
        r"check that this machine reaches that address \(firewall, a wrong IP\), then start this machine again "
        r"\(--rdzv_conf join_timeout=N waits longer\)",
        60),
    "frozen_machine": (
        "machine 1 of an elastic job (`--nnodes 1:2 --max_restarts 3`, `--stall_warning 4`) stopped with SIGSTOP "
        "(its agent and rank) after step 4, its connections left open",
        r"impel watchdog: rank 1 has sent no heartbeat for \d+ s while rank 0 waits for it in "
        r"(the preemption check|backward) "
        r"#\d+ \(for \d+ s\): its machine is frozen, stopped or cut off; rank 0 exits so that the elastic agent "
        r"restarts the job on the machines that answer, from the last checkpoint",
        240, "tests/cli/test_elastic.py"),
}


def round3_launch_rows(work: Path, cli: Callable[[list[str]], str], raises: Callable[[Callable[[], object]], str],
                       prepared: Callable[[int], Any]) -> list[Row]:
    """The one-process cases of issue 36's launcher part, then :data:`LAUNCH_CASES` as listed rows."""
    rows = _script_rows(work, cli) + _tool_rows(work, cli, prepared)
    os.environ["ACCELERATE_USE_FSDP"] = "maybe"
    try:
        rows.append(("environment", "`ACCELERATE_USE_FSDP=maybe`, `impel launch train.py`",
                     cli(["launch", "train.py"])))
        rows.append(("environment", "`ACCELERATE_USE_FSDP=maybe`, `Accelerator()`", raises(_accelerator)))
    finally:
        del os.environ["ACCELERATE_USE_FSDP"]
    for what, line, limit, *test in LAUNCH_CASES.values():
        shown = re.sub(r"\\(.)", r"\1", line.replace(r"\d+", "N"))
        where = test[0] if test else "tests/cli/test_round3_launch.py"
        rows.append((f"ranks (`{where}`, {limit} s limit, no rank left)", what, shown))
    return rows


def _accelerator() -> Any:
    from impel import Accelerator

    return Accelerator(cpu=True)


def _script_rows(work: Path, cli: Callable[[list[str]], str]) -> list[Row]:
    """A directory, a package directory, or a package without ``__main__.py`` given to ``impel launch``."""
    (work / "adir").mkdir()
    (work / "apkg").mkdir()
    (work / "apkg" / "__init__.py").write_text("")
    return [("launch flags", "`impel launch adir` (a directory)", cli(["launch", "adir"])),
            ("launch flags", "`impel launch apkg` (a package directory)", cli(["launch", "apkg"])),
            ("launch flags", "`impel launch -m apkg` (a package without `__main__.py`)", cli(["launch", "-m", "apkg"]))]


def _tool_rows(work: Path, cli: Callable[[list[str]], str], prepared: Callable[[int], Any]) -> list[Row]:
    (work / "ip.yaml").write_text('num_machines: 2\nnum_processes: 2\nmain_process_ip: "127.0.0.1:29500"\n')
    ck = work / "ck36"
    prepared(8).save_state(str(ck))
    return [("config file", "`impel config validate` of `num_machines: 2` / `main_process_ip: \"127.0.0.1:29500\"`",
             cli(["config", "validate", str(work / "ip.yaml")])),
            ("tools", "`impel merge-weights CK /proc/no_such_dir/out`",
             cli(["merge-weights", str(ck), "/proc/no_such_dir/out"])),
            ("tools", "`impel estimate-memory os:system`", cli(["estimate-memory", "os:system"]))]
