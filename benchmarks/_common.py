"""Helpers shared by the benchmark modules and ``run.py`` (modules starting with ``_`` are not benchmarks).

A benchmark module in this folder defines ``NAME`` (used for ``results/<NAME>.json``), ``DESCRIPTION`` and
``run(quick: bool = False) -> dict``. The dict is written to JSON (floats rounded); its ``rows`` entry (a list of
flat dicts with the same keys) is what ``run.py`` prints as a table.
"""
from __future__ import annotations

import os

# Must happen before torch is imported anywhere: intra-op threads would turn a 0.3 ms step into a scheduling test.
# Forced, not defaulted: the benchmarks' figures are defined for one thread.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import json  # noqa: E402
import platform  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


# Seconds every rank sits idle before a timed save and before each way of measuring the disk (CHECKPOINT_PAUSE_S,
# default 3). A save inside training comes after training steps, not right after another write of its size; on a
# virtual machine whose free memory goes back to the host a couple of seconds after it is freed (the development
# VM), a buffered write right after a large unlink reuses hot page-cache pages and runs several times faster than
# the same write made seconds later. Pausing before each measurement puts the disk and every save in the
# conditions of a save inside training. 0 gives the back-to-back figures.
PAUSE_S = float(os.environ.get("CHECKPOINT_PAUSE_S", "3"))


def pause() -> None:
    import time

    time.sleep(PAUSE_S)


def disk_write_bandwidth(directory: str, size: int) -> dict[str, float]:
    """Bytes/s of writing ``size`` bytes in 16 MiB blocks to a new file in ``directory``, durable at the end, three
    ways, each after :func:`pause`: write everything then fsync (``buffered``); write while a background thread
    fdatasyncs every 128 MiB (``pipelined``: impel's buffered fallback); ``O_DIRECT`` writes from a page-aligned
    buffer, then fsync (``direct``: impel's checkpoint writer where the file system allows it). Every way is
    reported: :func:`disk_reference` picks the one a run compares its saves with."""
    import mmap
    import threading
    import time

    block = os.urandom(16 << 20)
    aligned = mmap.mmap(-1, len(block))
    aligned[:] = block
    path = os.path.join(directory, "bandwidth.bin")
    out: dict[str, float] = {}
    for way in ("buffered", "pipelined", "direct"):
        if way == "direct" and not hasattr(os, "O_DIRECT"):
            continue
        pause()
        t0 = time.perf_counter()
        if way == "direct":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            written = 0
            while written < size:
                written += os.pwrite(fd, aligned, written)
            os.fsync(fd)
            os.close(fd)
        else:
            with open(path, "wb") as fh:
                written, flushed, flusher = 0, 0, None
                while written < size:
                    fh.write(block)
                    written += len(block)
                    if way == "pipelined" and written - flushed >= 128 << 20 and (flusher is None
                                                                                  or not flusher.is_alive()):
                        fh.flush()
                        flusher = threading.Thread(target=os.fdatasync, args=(fh.fileno(),))
                        flusher.start()
                        flushed = written
                if flusher is not None:
                    flusher.join()
                fh.flush()
                os.fsync(fh.fileno())
        out[way] = written / (time.perf_counter() - t0)
        os.unlink(path)
    aligned.close()
    return out


def disk_reference(measurements: Sequence[dict[str, float]]) -> tuple[str, list[float]]:
    """The disk a run's saves are compared with: the way of writing (:func:`disk_write_bandwidth`) with the highest
    median over the run, and its measurement at each point. Not the best way at each point: every way swings by
    up to 2x between neighbouring measurements on a VM, and the best of three noisy draws is biased upwards against
    a save, which is one draw (``save/best_of_3`` keeps that stricter figure beside it)."""
    import statistics

    ways = set(measurements[0]).intersection(*measurements)
    way = max(sorted(ways), key=lambda w: statistics.median(m[w] for m in measurements))
    return way, [m[way] for m in measurements]


def around(points: Sequence[float], saves: int) -> list[float]:
    """The disk each of ``saves`` saves is compared with: the mean of the measurements just before and just after
    it (``points`` has one more measurement than there are saves; the disk drifts within seconds on a VM, and one
    neighbour is one draw)."""
    if len(points) != saves + 1:
        raise ValueError(f"{len(points)} disk measurements for {saves} saves: one before each save and one after "
                         "the last are needed")
    return [(a + b) / 2 for a, b in zip(points, points[1:])]


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import impel

        info["impel"] = impel.__version__
    except ImportError:  # pragma: no cover - the benchmarks run from a checkout with impel installed
        info["impel"] = None
    info["commit"] = measured_commit()
    return info


def measured_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it (the figures are of that tree)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        # results written by this run's earlier benchmarks are not the measured tree
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)benchmarks/results")
        return head + ("+dirty" if changed else "")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist)
        return None


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table; columns are the keys of the first row, floats get 3 decimals."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0])

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in cols]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(cols), line(["-" * w for w in widths])]
    out.extend(line(b) for b in body)
    return "\n".join(out)


def _rounded(obj: Any, digits: int = 6) -> Any:
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


def write_json(name: str, payload: dict[str, Any], directory: Path = RESULTS) -> Path:
    """Write ``<directory>/<name>.json`` atomically (through a ``.tmp`` file, which git ignores).

    Floats are rounded to 6 decimals (nanoseconds, for the millisecond figures the benchmarks report).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_rounded(payload), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def evict(path: str) -> None:
    """Drop the (clean, fsynced) pages of every file under ``path`` from the page cache: the next read is cold."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rank_state(model, optimizer) -> dict:
    """This rank's model and optimizer tensors (a DTensor's local shard), by name: what a checkpoint holds of it."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    out = {f"model/{k}": local(v).detach() for k, v in model.state_dict().items()}
    for i, per_param in enumerate(optimizer.state.values()):
        for k, v in per_param.items():
            if hasattr(v, "shape"):
                out[f"optimizer/{i}/{k}"] = local(v).detach()
    return out
