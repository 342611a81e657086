"""Mutation testing for impel's suite: does some test fail when one line of a core module is wrong?

Each mutant is one textual edit (file, original text, replacement) in accumulation, data sharding, optimizer and
scheduler stepping, checkpoint layout and manifest, config merge, collectives, precision or the test harness. The
mutants are applied one at a time to a *copy* of the working tree (tracked and untracked files, not the ignored
ones), never to the checkout, so other work can go on in it; after each run the copy's file is restored and checked
byte for byte, and the checkout's file is checked to be untouched (same bytes, same ``git diff --quiet``). For each
mutant only the test files that cover that code run (``-x``, bounded by ``--timeout``); a mutant is *killed* when a
test fails, errors or hangs past the limit, and *survived* when the selected tests pass. Not part of ``make test``.

    python benchmarks/mutants.py                      # every mutant, on the working tree (code and tests)
    python benchmarks/mutants.py --tree-from HEAD     # the same mutants on the tree committed at HEAD
    python benchmarks/mutants.py --tests-from HEAD    # the working tree's code, the tests committed at HEAD
    python benchmarks/mutants.py --only config- --only ckpt-
    python benchmarks/mutants.py --list

Before the mutants, the union of the selected tests runs once unmutated (``--no-baseline`` skips it): a red
baseline would make every mutant look killed. A mutant whose original text is not in the tree under test (older
code) counts as n/a. Exit status: 0 when no mutant survived, 1 otherwise, 2 on an error.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT, MP = "tests/unit/", "tests/multiprocess/"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # test files (relative); files missing from the tests under test are dropped
    select: str = ""  # pytest -k expression, to keep the run short
    breaks: str = ""  # what the mutation breaks, in words


ACCUMULATION = (MP + "test_accumulation_and_schedule.py", UNIT + "test_gradient_accumulation.py")
DATA = (UNIT + "test_data_sharding.py", UNIT + "test_data_resume.py")
OPTIM = (UNIT + "test_optimizer_and_scheduler.py", MP + "test_accumulation_and_schedule.py")
CKPT = (UNIT + "test_checkpoint_layout.py", UNIT + "test_checkpoint_marker.py", UNIT + "test_checkpoint_corruption.py")
CONFIG = (UNIT + "test_config.py", UNIT + "test_fsdp_config.py")
COLLECTIVES = (MP + "test_collectives_and_state.py", MP + "test_gather_for_metrics.py")
PRECISION = (UNIT + "test_precision.py", UNIT + "test_trainer_training.py")
RESUME = (UNIT + "test_resilience.py", UNIT + "test_checkpoint_resume.py")
NOT_SLOW = "not timeout and not trackers"  # collectives: skip the 15 s timeout test and the trackers test

MUTANTS: tuple[Mutant, ...] = (
    # --- gradient accumulation and gradient sync ------------------------------------------------------------
    Mutant("acc-no-sync-ignored", "impel/runtime/step/accumulation.py",
           "        if self.manual_no_sync:\n            return False",
           "        if False:\n            return False", ACCUMULATION, breaks="no_sync() still all-reduces"),
    Mutant("acc-sync-each-batch-ignored", "impel/runtime/step/accumulation.py",
           "return self.sync_gradients or self.plugin.sync_each_batch", "return self.sync_gradients", ACCUMULATION,
           breaks="sync_each_batch=True keeps gradients local"),
    Mutant("acc-boundary-off-by-one", "impel/runtime/step/accumulation.py",
           "self.sync_gradients = self.micro_in_group >= self.group_size or at_end",
           "self.sync_gradients = self.micro_in_group > self.group_size or at_end", ACCUMULATION,
           breaks="groups one micro-step too long"),
    Mutant("acc-loss-divisor", "impel/runtime/step/accumulation.py", "return loss / self.group_size",
           "return loss / self.num_steps", ACCUMULATION + (MP + "test_ddp_equivalence.py",),
           breaks="a short last group divides by num_steps"),
    Mutant("acc-ignores-end-of-dataloader", "impel/runtime/step/accumulation.py",
           "at_end = self.plugin.sync_with_dataloader and self.end_of_dataloader", "at_end = False", ACCUMULATION,
           breaks="the last group of an epoch never syncs"),
    Mutant("acc-step-not-reset", "impel/runtime/step/accumulation.py", "self.step = 0 if at_end else self.step + 1",
           "self.step = self.step + 1", ACCUMULATION, breaks="accelerator.step keeps counting across epochs"),
    Mutant("ddp-sync-flag-ignored", "impel/strategies/ddp.py", "model.require_backward_grad_sync = enabled",
           "model.require_backward_grad_sync = True", ACCUMULATION,
           breaks="DDP reduces on every micro-step (no_sync and accumulation)"),
    # --- data sharding ----------------------------------------------------------------------------------------
    Mutant("data-same-slice-on-every-rank", "impel/runtime/loaders/shard_layout.py",
           "mine = slice(rank * per_rank, (rank + 1) * per_rank)", "mine = slice(0, per_rank)", DATA,
           breaks="every rank reads the same samples"),
    Mutant("data-no-even-padding", "impel/runtime/loaders/shard_layout.py",
           "            if self.even_batches and world > 1:",
           "            if False:", DATA, breaks="even_batches does not pad the last batch"),
    Mutant("data-drop-last-ignored", "impel/runtime/loaders/shard_layout.py",
           "        if buf and not self.drop_last and produced >= skip:", "        if buf and produced >= skip:", DATA,
           breaks="drop_last keeps the short batch"),
    Mutant("data-ranks-keep-their-own-generator", "impel/runtime/loaders/data.py",
           "        _agree_on_generator(sampler)",
           "        pass", DATA + (MP + "test_collectives_and_state.py",), NOT_SLOW,
           breaks="ranks seeded differently shuffle differently"),
    Mutant("data-resume-draws-again", "impel/runtime/loaders/prepared_loader.py",
           "        if replay is not None:\n            torch.set_rng_state(replay)",
           "        if False:\n            torch.set_rng_state(replay)", DATA,
           breaks="a resumed pass consumes the global RNG a second time (dropout drifts)"),
    Mutant("data-epoch-never-advances", "impel/runtime/loaders/prepared_loader.py",
           "                self.epoch += 1", "                pass",
           DATA + (MP + "test_collectives_and_state.py",), NOT_SLOW, breaks="every epoch has the same shuffle"),
    Mutant("data-remainder-full-batch", "impel/runtime/loaders/shard_layout.py",
           "        return g if rest == 0 or self.drop_last else rest", "        return g",
           DATA + (MP + "test_gather_for_metrics.py",), breaks="gather_for_metrics keeps the padding"),
    Mutant("data-skip-ignored", "impel/runtime/loaders/prepared_loader.py", "        self.shard.skip = self._skip_next",
           "        pass",
           DATA + RESUME, breaks="a resumed loader starts the epoch over"),
    # --- optimizer and scheduler stepping ----------------------------------------------------------------------
    Mutant("opt-zero-grad-mid-group", "impel/runtime/step/optimizer.py",
           "        if self.gradient_state.sync_gradients:\n            self.strategy.zero_grad",
           "        if True:\n            self.strategy.zero_grad", OPTIM, breaks="zero_grad() clears mid-group"),
    Mutant("opt-step-mid-group", "impel/runtime/step/optimizer.py",
           "        if not gs.sync_gradients:\n            return\n",
           "        if False:\n            return\n", OPTIM, breaks="the optimizer steps on every micro-step"),
    Mutant("sched-steps-mid-group", "impel/runtime/step/optimizer.py", "if not self.gradient_state.sync_gradients:",
           "if False:", OPTIM, breaks="the scheduler steps on micro-steps"),
    Mutant("sched-steps-on-skipped", "impel/runtime/step/optimizer.py",
           "if any(opt.step_was_skipped for opt in self.optimizers):", "if False:",
           OPTIM + (UNIT + "test_precision.py",), breaks="the scheduler steps after a skipped fp16 step"),
    # --- checkpoint layout, marker, manifest, resume --------------------------------------------------------------
    Mutant("ckpt-marker-not-checked", "impel/checkpoint/store/layout.py",
           "if marker != hashlib.sha256(text.encode()).hexdigest():", "if False:", CKPT,
           breaks="an edited manifest loads"),
    Mutant("ckpt-missing-file-not-named", "impel/checkpoint/store/layout.py",
           "        if not (directory / rel).is_file():", "        if False:", CKPT,
           breaks="a missing file fails with FileNotFoundError instead of naming the checkpoint file"),
    Mutant("ckpt-size-not-checked", "impel/checkpoint/store/layout.py", "        if size != entry[\"size\"]:",
           "        if False:", CKPT, breaks="a truncated file is caught by the block digests only"),
    Mutant("ckpt-blocks-not-checked", "impel/checkpoint/store/layout.py",
           "bad = hashing.first_bad_block(files[rel][key], got)", "bad = None", CKPT,
           breaks="a flipped byte in a file no impel reader reads (a hook's) loads"),
    Mutant("ckpt-blocks-not-checked-on-read", "impel/checkpoint/io/verified.py",
           "bad = hashing.first_bad_block(found[1], got)", "bad = None", CKPT,
           breaks="a flipped byte in impel's own files loads"),
    Mutant("ckpt-marker-optional", "impel/checkpoint/store/layout.py",
           "return (directory / MARKER_FILE).is_file() and (directory / METADATA_FILE).is_file()",
           "return (directory / METADATA_FILE).is_file()", CKPT, breaks="an interrupted save counts as complete"),
    Mutant("ckpt-marker-hashes-nothing", "impel/checkpoint/store/layout.py",
           "_write_text(temp / MARKER_FILE, hashlib.sha256(text.encode()).hexdigest() + \"\\n\")",
           "_write_text(temp / MARKER_FILE, \"complete\\n\")", CKPT, breaks="the marker seals no manifest"),
    Mutant("ckpt-rotation-keeps-oldest", "impel/checkpoint/store/layout.py",
           "doomed = [path for _, path in found[: max(0, len(found) - total_limit)]]",
           "doomed = [path for _, path in found[total_limit:]]", CKPT, breaks="total_limit deletes the newest"),
    Mutant("resume-model-not-loaded", "impel/checkpoint/formats/full.py",
           "        if i in skip_models:\n            continue\n        state = read_weights",
           "        if True:\n            continue\n        state = read_weights", RESUME,
           breaks="load_state leaves the model's weights as they were"),
    Mutant("resume-rng-not-restored", "impel/checkpoint/saving/state.py", "    torch.set_rng_state(state[\"torch\"])",
           "    pass", RESUME, breaks="a resumed run draws different random numbers (dropout, shuffles)"),
    # --- config merge -------------------------------------------------------------------------------------
    Mutant("config-falsy-launched-is-unset", "impel/config/run_config.py",
           "    if launched is not None and launched != value:", "    if launched and launched != value:",
           CONFIG, breaks="a launched false / 0 / \"\" is overridden without the log line naming both"),
    Mutant("config-contradiction-ignored", "impel/config/run_config.py",
           "        if not where and key == \"distributed_type\":", "        if False:", CONFIG,
           breaks="a plugin in the code silently replaces the launched strategy"),
    Mutant("config-code-does-not-fill", "impel/config/run_config.py", "    target[key] = value", "    pass", CONFIG,
           breaks="code arguments are ignored"),
    # --- collectives -----------------------------------------------------------------------------------------
    Mutant("coll-mean-is-sum", "impel/runtime/ranks/collectives.py",
           "t = t / dist.get_world_size()", "t = t / 1", COLLECTIVES,
           NOT_SLOW, breaks="reduce('mean') sums"),
    Mutant("coll-gather-reversed", "impel/runtime/ranks/collectives.py", "return torch.cat(out, dim=0)",
           "return torch.cat(out[::-1], dim=0)", COLLECTIVES, NOT_SLOW, breaks="gather puts rank 1 first"),
    Mutant("coll-pad-first-ignored", "impel/runtime/ranks/collectives.py",
           "index[dim] = slice(target - t.shape[dim], target) if pad_first else slice(0, t.shape[dim])",
           "index[dim] = slice(0, t.shape[dim])", COLLECTIVES, NOT_SLOW, breaks="pad_first pads at the end"),
    Mutant("coll-no-truncate", "impel/runtime/ranks/collectives.py", "recursively_apply(lambda t: t[:length], data)",
           "recursively_apply(lambda t: t, data)", COLLECTIVES, NOT_SLOW,
           breaks="gather_for_metrics returns the even-batches duplicates"),
    Mutant("coll-gather-object-not-flattened", "impel/runtime/ranks/collectives.py",
           "return [x for o in out for x in o]",
           "return out", COLLECTIVES, NOT_SLOW, breaks="gather_object returns one list per rank"),
    # --- precision -----------------------------------------------------------------------------------------------
    Mutant("prec-no-autocast", "impel/runtime/step/model_forward.py",
           "    if ctx.autocast is None:", "    if True:", PRECISION,
           breaks="mixed precision never autocasts"),
    Mutant("prec-bf16-is-fp16", "impel/runtime/step/precision.py", "    mode = \"bf16\"\n    dtype = torch.bfloat16",
           "    mode = \"bf16\"\n    dtype = torch.float16", PRECISION, breaks="bf16 autocasts to float16"),
    Mutant("prec-skip-not-reported", "impel/runtime/step/precision.py",
           "return not self.scaler.is_enabled() or self.scaler.get_scale() >= scale_before", "return True",
           PRECISION[:1] + OPTIM[:1], breaks="a skipped fp16 step is reported as taken"),
    Mutant("prec-unscale-twice", "impel/runtime/step/precision.py",
           "if id(optimizer) not in self._unscaled:", "if True:",
           PRECISION[:1] + OPTIM[:1], breaks="fp16 gradients unscaled twice when clipping"),
    # --- the test harness ------------------------------------------------------------------------------------
    Mutant("harness-env-snapshot", "impel/testing.py", "    os.environ.clear()\n    os.environ.update(environ)",
           "    os.environ.update({k: environ[k] for k in ('WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', "
           "'MASTER_PORT', 'TORCHELASTIC_RESTART_COUNT', 'TORCHELASTIC_USE_AGENT_STORE', 'OMP_NUM_THREADS')})",
           (MP + "test_run_on_ranks.py",), breaks="ranks see the forkserver's environment, not the caller's"),
    Mutant("env-ds-accelerator-leaks", "impel/config/environment.py",
           "    with scoped_environ({\"DS_ACCELERATOR\": device_type} if device_type in (\"cpu\", \"cuda\") else {}):",
           "    with contextlib.nullcontext(os.environ.update({\"DS_ACCELERATOR\": device_type})):",
           (UNIT + "test_deepspeed_config.py",), "ds_accelerator", breaks="DS_ACCELERATOR stays set for good"),
)


# --- the copy ---------------------------------------------------------------------------------------------------
def git(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=check, timeout=120)


def copy_tree(dest: Path, tree_from: str | None, tests_from: str | None) -> None:
    """The working tree's tracked and untracked (not ignored) files, or a git revision's tree; ``tests/`` from a
    git revision if asked."""
    if tree_from:
        extract(tree_from, dest)
    else:
        listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout.decode().split("\0")
        for rel in filter(None, listed):
            src = ROOT / rel
            if src.is_file():  # a tracked file deleted in the working tree is skipped
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    if tests_from:
        shutil.rmtree(dest / "tests")
        extract(tests_from, dest, "tests")


def extract(rev: str, dest: Path, *paths: str) -> None:
    archive = git("archive", "--format=tar", rev, *paths).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkout_state(rel: str) -> tuple[str, int]:
    """The checkout's file (bytes, ``git diff --quiet`` status): this script never writes it."""
    path = ROOT / rel
    return (digest(path) if path.is_file() else ""), git("diff", "--quiet", "--", rel, check=False).returncode


# --- running ------------------------------------------------------------------------------------------------------
def run_tests(copy: Path, tests: list[str], select: str, timeout: float) -> tuple[str, float, str]:
    """("killed" | "survived" | "error", seconds, the first failing test or the reason)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    if select:
        cmd += ["-k", select]
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "killed", time.monotonic() - start, f"hung past {timeout:.0f}s"
    seconds = time.monotonic() - start
    first = next((line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    if proc.returncode in (0, 5):  # 5: the selection ran no test
        return "survived", seconds, "" if proc.returncode == 0 else "no test selected"
    if proc.returncode in (1, 2, 3):  # failed; interrupted by a collection error; internal error
        return "killed", seconds, first or out.strip().splitlines()[-1]
    return "error", seconds, out[-1500:]


def present(copy: Path, tests: tuple[str, ...]) -> list[str]:
    return [t for t in tests if (copy / t).is_file()]


def run_mutant(copy: Path, m: Mutant, timeout: float) -> tuple[str, float, str]:
    target = copy / m.path
    text = target.read_text(encoding="utf-8")
    if text.count(m.original) == 0:
        return "n/a", 0.0, f"the original text is not in {m.path} of this tree"
    if text.count(m.original) > 1:
        return "error", 0.0, f"the original text occurs {text.count(m.original)} times in {m.path}; make it unique"
    tests = present(copy, m.tests)
    if not tests:
        return "survived", 0.0, "no test file selected"
    before = checkout_state(m.path)
    try:
        target.write_text(text.replace(m.original, m.replacement), encoding="utf-8")
        return run_tests(copy, tests, m.select, timeout)
    finally:
        target.write_text(text, encoding="utf-8")
        if digest(target) != hashlib.sha256(text.encode("utf-8")).hexdigest():
            raise SystemExit(f"could not restore the copy of {m.path}")
        if checkout_state(m.path) != before:  # someone else edited it meanwhile: the run used the copy's snapshot
            print(f"note: {m.path} changed in the checkout during this mutant (not by this script)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run mutants whose name starts with this")
    parser.add_argument("--tree-from", metavar="REV", help="test the tree of this git revision (e.g. HEAD)")
    parser.add_argument("--tests-from", metavar="REV", help="take tests/ from this git revision (e.g. HEAD)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per mutant (default 240)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    ns = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not ns.only or any(m.name.startswith(p) for p in ns.only)]
    if ns.list:
        for m in chosen:
            print(f"{m.name:34} {m.path:28} {m.breaks}")
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="impel-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy, ns.tree_from, ns.tests_from)
        tests_label = (f"the tree of {ns.tree_from}" if ns.tree_from else "the working tree") + (
            f", tests from {ns.tests_from}" if ns.tests_from else "")
        print(f"{len(chosen)} mutants, {tests_label}, copy in {copy}", flush=True)
        if not ns.no_baseline:
            union = sorted({t for m in chosen for t in present(copy, m.tests)})
            outcome, seconds, why = run_tests(copy, union, "", 3 * ns.timeout)
            print(f"baseline ({len(union)} files, {seconds:.0f}s): {'green' if outcome == 'survived' else why}",
                  flush=True)
            if outcome != "survived":
                return 2
        counts = {"killed": 0, "survived": 0, "n/a": 0, "error": 0}
        survivors = []
        for m in chosen:
            outcome, seconds, why = run_mutant(copy, m, ns.timeout)
            counts[outcome] += 1
            if outcome == "survived":
                survivors.append(m)
            print(f"{outcome.upper():9} {m.name:34} {seconds:5.0f}s  {why[:110]}", flush=True)
    total = counts["killed"] + counts["survived"]
    print(f"\n{counts['killed']} of {total} killed, {counts['survived']} survived, {counts['n/a']} n/a, "
          f"{counts['error']} errors ({tests_label}; {time.monotonic() - started:.0f}s)")
    for m in survivors:
        print(f"  survived: {m.name} ({m.path}): {m.breaks}")
    return 2 if counts["error"] else (1 if survivors else 0)


if __name__ == "__main__":
    sys.exit(main())
