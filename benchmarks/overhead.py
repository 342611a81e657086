"""Step overhead: the fixed cost impel adds to one training step, against a hand-written torch loop.

The model is deliberately tiny (Linear(32,32)-ReLU-Linear(32,1), batch 8, SGD, MSE, one CPU thread, one process)
so that a step is a few tenths of a millisecond and the library's Python bookkeeping is what the difference shows.
Every variant starts from the same weights and sees the same batches in the same order, and their final weights
are checked to agree, so all variants do the same arithmetic.

Two measures:

* ``step``: no accumulation; extra milliseconds per optimizer step.
* ``micro-step``: ``gradient_accumulation_steps=4`` (``with accelerator.accumulate(model)``) against a hand-written
  loop that divides the loss by 4 and steps every 4th batch; extra milliseconds per micro-step (per batch).

Each is measured with two feeds: pre-built batch tensors in a list (the step cost alone) and a prepared
DataLoader over a TensorDataset (the step cost plus the data path). The hand-written loop runs both the list and a
plain torch DataLoader, so the report separates torch's own DataLoader cost from what the wrapper adds.
Repetitions interleave all variants in a shuffled order; a repetition's delta is the library's time per step
minus the torch loop's time per step in the same repetition, and the report gives the min and median of those,
plus ``floor`` (quietest library run minus quietest torch run) and the extra function calls per step (cProfile,
deterministic). Times are process CPU time, which leaves out the time other processes hold the CPU; wall-clock
times are kept in the JSON as well. Everything runs on one thread (``OMP_NUM_THREADS=1``).

If ``accelerate`` is importable (``pip install -e '.[bench]'``) it is measured the same way in the same run.

Run alone with ``python benchmarks/overhead.py``; ``--profile`` prints cProfiles of impel's loops instead.
"""
from __future__ import annotations

import _common  # noqa: F401  (first: pins OMP_NUM_THREADS before torch is imported)

# isort: split

import argparse
import gc
import importlib.util
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NAME = "overhead"
DESCRIPTION = "fixed per-step cost of impel (and accelerate) over a hand-written torch loop, tiny MLP on CPU"

# Measured with the same model on the reference machine (2 cores); the target is a quarter of it.
ACCELERATE_REFERENCE_MS = {"step": 0.13, "micro-step": 0.125}
TARGET_MS = {"step": 0.033, "micro-step": 0.033}


@dataclass
class Config:
    features: int = 32
    hidden: int = 32
    batch_size: int = 8
    # Short runs, many repetitions: on a shared 2-core machine the load changes on a scale of seconds, so
    # adjacent short runs see the same conditions and the per-repetition deltas are much less noisy.
    batches_per_epoch: int = 128  # a multiple of accumulation_steps: every group is full, no epoch-end sync
    epochs_per_run: int = 1
    repetitions: int = 60
    accumulation_steps: int = 4
    lr: float = 0.01
    seed: int = 0

    @property
    def steps_per_run(self) -> int:
        return self.batches_per_epoch * self.epochs_per_run


# A/A control: a second, identical hand-written loop over the tensors. Its delta against the first one is the
# benchmark's own noise in that run; a library delta within that band is not distinguishable from zero.
AA = "torch A/A"

QUICK = dict(batches_per_epoch=32, epochs_per_run=1, repetitions=5)


# --- the loops ------------------------------------------------------------------------------------------------
# Written out one by one, with the same shape, so that the only difference is the library calls.

def torch_steps(model: nn.Module, opt: torch.optim.Optimizer, data: Any, epochs: int, k: int) -> None:
    for _ in range(epochs):
        for x, y in data:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()


def torch_accumulate(model: nn.Module, opt: torch.optim.Optimizer, data: Any, epochs: int, k: int) -> None:
    n = 0
    for _ in range(epochs):
        for x, y in data:
            loss = F.mse_loss(model(x), y) / k
            loss.backward()
            n += 1
            if n % k == 0:
                opt.step()
                opt.zero_grad()


def library_steps(acc: Any, model: nn.Module, opt: Any, data: Any, epochs: int) -> None:
    for _ in range(epochs):
        for x, y in data:
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()


def library_accumulate(acc: Any, model: nn.Module, opt: Any, data: Any, epochs: int) -> None:
    for _ in range(epochs):
        for x, y in data:
            with acc.accumulate(model):
                loss = F.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()


# --- variants -------------------------------------------------------------------------------------------------

@dataclass
class Variant:
    library: str  # torch | impel | accelerate
    feed: str  # tensors | dataloader
    model: nn.Module
    optimizer: Any
    loop: Callable[[int], None]
    init: list[torch.Tensor]
    ms_per_step: list[float] = field(default_factory=list)  # process CPU time
    wall_ms_per_step: list[float] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return self.library, self.feed

    def reset(self) -> None:
        with torch.no_grad():
            for p, p0 in zip(self.model.parameters(), self.init):
                p.copy_(p0)
        self.optimizer.zero_grad(set_to_none=True)

    def timed_run(self, cfg: Config) -> tuple[float, float]:
        """One run from the initial weights; returns (CPU, wall) milliseconds per micro-step."""
        self.reset()
        w0, c0 = time.perf_counter_ns(), time.process_time_ns()
        self.loop(cfg.epochs_per_run)
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        per = 1e6 * cfg.steps_per_run
        return (c1 - c0) / per, (w1 - w0) / per

    def profiled_run(self, cfg: Config) -> Any:
        """One run under cProfile; returns the ``pstats.Stats``."""
        import cProfile
        import pstats

        self.reset()
        prof = cProfile.Profile()
        prof.runcall(self.loop, cfg.epochs_per_run)
        return pstats.Stats(prof)


def make_model(cfg: Config) -> nn.Module:
    torch.manual_seed(cfg.seed)
    return nn.Sequential(nn.Linear(cfg.features, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 1))


def make_data(cfg: Config) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], TensorDataset]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    n = cfg.batches_per_epoch * cfg.batch_size
    x = torch.randn(n, cfg.features, generator=g)
    y = torch.randn(n, 1, generator=g)
    b = cfg.batch_size
    batches = [(x[i:i + b].clone(), y[i:i + b].clone()) for i in range(0, n, b)]
    return batches, TensorDataset(x, y)


def make_loader(cfg: Config, dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=cfg.batch_size, shuffle=False)  # same order as the list


def accelerate_version() -> str | None:
    if importlib.util.find_spec("accelerate") is None:
        return None
    try:
        import accelerate
    except Exception:  # noqa: BLE001 - a broken optional install must not stop the benchmark
        return None
    return accelerate.__version__


def _reset_accelerate() -> None:
    # accelerate keeps process-wide singletons; a fresh state per mode keeps the modes independent.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def build_variants(cfg: Config, k: int, libraries: list[str]) -> list[Variant]:
    batches, dataset = make_data(cfg)
    variants: list[Variant] = []
    raw = torch_steps if k == 1 else torch_accumulate
    lib_loop = library_steps if k == 1 else library_accumulate
    for library in libraries:
        if library == "accelerate":
            _reset_accelerate()
        for feed in ("tensors",) if library == AA else ("tensors", "dataloader"):
            model = make_model(cfg)
            init = [p.detach().clone() for p in model.parameters()]
            opt: Any = torch.optim.SGD(model.parameters(), lr=cfg.lr)
            data: Any = batches if feed == "tensors" else make_loader(cfg, dataset)
            if library in ("torch", AA):
                def loop(epochs: int, m=model, o=opt, d=data) -> None:
                    raw(m, o, d, epochs, k)
            else:
                if library == "impel":
                    from impel import Accelerator
                else:
                    from accelerate import Accelerator
                acc = Accelerator(cpu=True, gradient_accumulation_steps=k)
                if feed == "tensors":
                    model, opt = acc.prepare(model, opt)
                else:
                    model, opt, data = acc.prepare(model, opt, data)

                def loop(epochs: int, a=acc, m=model, o=opt, d=data) -> None:
                    lib_loop(a, m, o, d, epochs)
            variants.append(Variant(library, feed, model, opt, loop, init))
    return variants


def _params(v: Variant) -> list[torch.Tensor]:
    return [p.detach().clone() for p in v.model.parameters()]


def measure_mode(cfg: Config, k: int, libraries: list[str], rng: random.Random) -> dict[str, Any]:
    variants = build_variants(cfg, k, libraries)
    # Warm-up run of every variant, which is also the check that all of them computed the same thing.
    finals = {}
    for v in variants:
        v.timed_run(cfg)
        v.timed_run(cfg)
        finals[v.key] = _params(v)
    ref = finals[("torch", "tensors")]
    max_diff = {f"{lib}/{feed}": max(float((a - b).abs().max()) for a, b in zip(ps, ref))
                for (lib, feed), ps in finals.items()}
    bad = {name: d for name, d in max_diff.items() if d > 1e-5}
    if bad:
        raise RuntimeError(f"variants disagree with the hand-written loop after one run (max |dw|): {bad}")
    # Function calls per micro-step (Python and C, as cProfile counts them): a deterministic view of the same
    # overhead, unaffected by the machine's load.
    calls = {f"{v.library}/{v.feed}": v.profiled_run(cfg).total_calls / cfg.steps_per_run for v in variants}
    for _ in range(cfg.repetitions):
        order = list(variants)
        rng.shuffle(order)
        gc.collect()  # once per repetition: a collection per run would cost more than the runs themselves
        for v in order:
            cpu, wall = v.timed_run(cfg)
            v.ms_per_step.append(cpu)
            v.wall_ms_per_step.append(wall)
    return {"accumulation_steps": k, "max_abs_weight_diff": max_diff, "calls_per_step": calls,
            "ms_per_step": {f"{v.library}/{v.feed}": v.ms_per_step for v in variants},
            "wall_ms_per_step": {f"{v.library}/{v.feed}": v.wall_ms_per_step for v in variants}}


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(measure: str, mode: dict[str, Any], libraries: list[str]) -> tuple[list[dict[str, Any]], dict]:
    """Table rows and per-repetition deltas for one measure.

    ``median_ms`` and ``min_ms`` are the median and min over repetitions of (library - baseline) in the same
    repetition. ``floor_ms`` is min(library) - min(baseline): each side's quietest run, the estimate least
    affected by other load on the machine (the min of the deltas is the most affected: one disturbed baseline
    run makes it negative). ``extra_calls`` is the difference in function calls per micro-step (cProfile).
    """
    times = mode["ms_per_step"]
    calls = mode["calls_per_step"]
    rows: list[dict[str, Any]] = []
    deltas: dict[str, Any] = {}

    def add(lib: str, feed: str, against: str, target: float | None, ref: float | None) -> None:
        mine, base = times[f"{lib}/{feed}"], times[against]
        d = [a - b for a, b in zip(mine, base)]
        s = _stats(d)
        floor = min(mine) - min(base)
        extra_calls = calls[f"{lib}/{feed}"] - calls[against]
        deltas[f"{lib}/{feed} - {against}"] = {**s, "floor": floor, "extra_calls_per_step": extra_calls,
                                               "per_repetition": d}
        rows.append({"measure": measure, "library": lib, "feed": feed, "against": against,
                     "base_ms": statistics.median(base), "median_ms": s["median"], "min_ms": s["min"],
                     "floor_ms": floor, "extra_calls": round(extra_calls, 1), "target_ms": target,
                     "accel_ref_ms": ref,
                     "ok": None if target is None else s["median"] <= target})

    add(AA, "tensors", "torch/tensors", None, None)
    add("torch", "dataloader", "torch/tensors", None, None)
    for lib in libraries:
        if lib in ("torch", AA):
            continue
        add(lib, "tensors", "torch/tensors", TARGET_MS[measure] if lib == "impel" else None,
            ACCELERATE_REFERENCE_MS[measure] if lib == "accelerate" else None)
        add(lib, "dataloader", "torch/tensors", None, None)
        add(lib, "dataloader", "torch/dataloader", None, None)
    return rows, deltas


def run(quick: bool = False, repetitions: int | None = None, use_accelerate: bool = True) -> dict[str, Any]:
    cfg = Config(**QUICK) if quick else Config()
    if repetitions is not None:
        cfg.repetitions = repetitions
    torch.set_num_threads(1)
    acc_version = accelerate_version() if use_accelerate else None
    libraries = ["torch", AA, "impel"] + (["accelerate"] if acc_version else [])
    rng = random.Random(cfg.seed)
    load_start = list(os.getloadavg())
    started = time.perf_counter()
    modes = {"step": measure_mode(cfg, 1, libraries, rng),
             "micro-step": measure_mode(cfg, cfg.accumulation_steps, libraries, rng)}
    rows: list[dict[str, Any]] = []
    deltas: dict[str, Any] = {}
    for measure, mode in modes.items():
        r, d = summarize(measure, mode, libraries)
        rows += r
        deltas[measure] = d
    headline: dict[str, Any] = {}
    summary: list[str] = []
    for measure in modes:
        d = deltas[measure]
        step = d["impel/tensors - torch/tensors"]
        loader = d["impel/dataloader - torch/dataloader"]
        entry: dict[str, Any] = {
            "impel_median_ms": step["median"], "impel_min_ms": step["min"], "impel_floor_ms": step["floor"],
            "impel_extra_calls_per_step": step["extra_calls_per_step"],
            "impel_dataloader_vs_torch_dataloader_median_ms": loader["median"],
            "aa_noise_median_ms": d[f"{AA}/tensors - torch/tensors"]["median"],
            "target_ms": TARGET_MS[measure], "accelerate_reference_ms": ACCELERATE_REFERENCE_MS[measure],
            "meets_target": step["median"] <= TARGET_MS[measure]}
        if acc_version:
            entry["accelerate_median_ms"] = d["accelerate/tensors - torch/tensors"]["median"]
        headline[measure] = entry
        unit = "optimizer step" if measure == "step" else f"micro-step (accumulation {cfg.accumulation_steps})"
        line = (f"impel adds {step['median']:.3f} ms per {unit} (median; min {step['min']:.3f}, floor "
                f"{step['floor']:.3f}, {step['extra_calls_per_step']:+.0f} calls); target <= {TARGET_MS[measure]:.3f}: "
                f"{'met' if entry['meets_target'] else 'NOT met'}")
        if acc_version:
            line += f"; accelerate {acc_version} here {entry['accelerate_median_ms']:.3f}"
        line += f" (reference {ACCELERATE_REFERENCE_MS[measure]:.3f})"
        summary.append(line)
        aa = d[f"{AA}/tensors - torch/tensors"]
        summary.append(f"  with a prepared DataLoader, against a plain torch DataLoader: {loader['median']:+.3f} ms "
                       f"per {measure}; A/A noise (torch vs torch): median {aa['median']:+.3f}, floor "
                       f"{aa['floor']:+.3f}")
    if not acc_version:
        summary.append("accelerate is not importable: install the bench extra (pip install -e '.[bench]') to "
                       "measure it in the same run")
    load = os.getloadavg()
    if load[0] > 1.5:
        summary.append(f"note: load average {load[0]:.1f} on {os.cpu_count()} CPUs at the end of the run; "
                       "other work was competing, expect noisy figures")
    return {
        "name": NAME,
        "description": DESCRIPTION,
        "config": {**cfg.__dict__, "steps_per_run": cfg.steps_per_run, "quick": quick},
        "environment": {**_common.environment(), "accelerate": acc_version,
                        "load_average_start": load_start, "load_average_end": list(load)},
        "units": "milliseconds per micro-step (= per optimizer step when accumulation_steps is 1)",
        "headline": headline,
        "summary": summary,
        "rows": rows,
        "deltas": deltas,
        "modes": modes,
        "seconds": time.perf_counter() - started,
    }


# --- profiling --------------------------------------------------------------------------------------------------

def profile(cfg: Config, k: int, feed: str = "tensors", top: int = 15) -> str:
    """cProfile of impel's loop: calls per step against the torch loop, impel's own frames, the top frames."""
    import io

    variants = {v.library: v for v in build_variants(cfg, k, ["torch", "impel"]) if v.feed == feed}
    for v in variants.values():
        v.timed_run(cfg)  # warm-up
    base = variants["torch"].profiled_run(cfg)
    stats = variants["impel"].profiled_run(cfg)
    n = cfg.steps_per_run
    out = io.StringIO()
    stats.stream = out
    print(f"impel, gradient_accumulation_steps={k}, {feed}, {n} micro-steps: {stats.total_calls / n:.1f} calls per "
          f"micro-step (torch loop {base.total_calls / n:.1f}, +{(stats.total_calls - base.total_calls) / n:.1f})",
          file=out)
    print("impel's own frames (cumulative time includes the torch work they call):", file=out)
    stats.sort_stats("tottime").print_stats(r"/impel/", top)
    print("all frames:", file=out)
    stats.sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few short repetitions (smoke test)")
    parser.add_argument("--repetitions", type=int, default=None)
    parser.add_argument("--no-accelerate", action="store_true", help="skip accelerate even if installed")
    parser.add_argument("--profile", action="store_true", help="print cProfiles of impel's loops instead")
    args = parser.parse_args(argv)
    if args.profile:
        torch.set_num_threads(1)
        cfg = Config(batches_per_epoch=512)
        for k in (1, cfg.accumulation_steps):
            for feed in ("tensors", "dataloader"):
                print(profile(cfg, k, feed), end="\n\n")
        return 0
    result = run(quick=args.quick, repetitions=args.repetitions, use_accelerate=not args.no_accelerate)
    print(_common.format_table(result["rows"]))
    print("\n".join(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
