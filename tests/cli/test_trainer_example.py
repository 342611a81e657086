"""The seed exercise (examples/train_genre_classifier.py: impel's Trainer, i.e. transformers' Trainer on impel's
Accelerator) runs under ``impel launch`` on 2 CPU ranks, shortened.

A few steps cannot show the accuracy (docs/trainer.md has the full run's number); this checks that the run finishes, the
main process alone prints the accuracy and the plot path, the files land where they are announced, and that the same
script on transformers' own Trainer (Accelerate under torchrun) logs the same numbers and saves the same weights.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from cli_helpers import ROOT, clean_env, impel

pytest.importorskip("datasets")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "train_genre_classifier.py"


TINY = ["--max_steps", "2", "--train_per_class", "16", "--test_per_class", "6", "--batch_size", "4", "--max_length",
        "24", "--eval_steps", "2", "--logging_steps", "1", "--disable_tqdm", "--save_strategy", "steps"]


def load_example():
    spec = importlib.util.spec_from_file_location("train_genre_classifier", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_test_passages_are_read_in_chunks_and_their_logits_averaged():
    """A 16-line test passage is 4 consecutive 4-line chunks of one test play, in order; its prediction is the
    mean of its chunks' logits (not a vote): one confident right chunk outweighs three barely wrong ones."""
    example = load_example()
    np = pytest.importorskip("numpy")
    train, test, _ = example.build_split(4, 16, 8, 3, seed=0)
    assert len(train["text"]) == 16 and len(test["text"]) == 2 * 3 * 4 and test["label"] == [0] * 12 + [1] * 12
    plays = example.find_plays()
    play_text = {n: example.text(example.spoken_lines(path)) for genre in plays for n, path in plays[genre].items()
                 if n in example.TEST_PLAYS[genre]}
    for first in range(0, len(test["text"]), 4):
        chunks = test["text"][first:first + 4]
        assert all(chunk.count(" / ") == 3 for chunk in chunks)
        assert any(" / ".join(chunks) in whole for whole in play_text.values())  # 16 consecutive lines
    logits = np.array([[2.0, -2.0], [0.0, 0.1], [0.0, 0.1], [0.0, 0.1],  # passage of label 0
                       [0.0, 0.5], [0.1, 0.0], [0.1, 0.0], [0.1, 0.0]])  # label 1
    assert example.passage_accuracy(logits, np.array([0] * 4 + [1] * 4), 4) == {"accuracy": 1.0,
                                                                                "chunk_accuracy": 0.25}
    with pytest.raises(RuntimeError, match="reordered the test chunks"):
        example.passage_accuracy(logits, np.array([0, 1] * 4), 4)
    with pytest.raises(SystemExit, match="not a multiple of --lines_per_passage 4; use 12"):
        example.build_split(4, 14, 8, 3, seed=0)


def test_genre_example_runs_on_two_ranks_and_reports(tmp_path):
    out = tmp_path / "run"
    res = impel(["launch", "--config_file", str(ROOT / "examples" / "configs" / "ddp_cpu.yaml"), str(EXAMPLE), *TINY,
                 "--output_dir", str(out)], tmp_path, timeout=150)
    assert res.returncode == 0, res.output[-4000:]
    assert "Traceback" not in res.output
    accuracy = re.findall(r"^eval accuracy: ([0-9.]+) on 12 passages of unseen plays \(chance 0.5; [0-9.]+ on "
                          r"their 48 chunks\)", res.stdout, flags=re.MULTILINE)
    assert len(accuracy) == 1 and 0.0 <= float(accuracy[0]) <= 1.0  # printed once, by the main process
    assert "impel Trainer on 2 process(es) (MULTI_CPU), global batch 8" in res.stdout
    assert "split (by play)" in res.stdout and "test tragedy: macbeth, othello" in res.stdout
    plot = re.findall(r"^loss plot: (.+)$", res.stdout, flags=re.MULTILINE)
    if plot != ["not written (pip install matplotlib)"]:
        assert plot == [str(out / "loss.png")] and (out / "loss.png").read_bytes().startswith(b"\x89PNG")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [2]
    assert_as_transformers_on_accelerate(out / "checkpoint-2", tmp_path)


def assert_as_transformers_on_accelerate(checkpoint, tmp_path):
    """The example with transformers' imports instead of impel's, under torchrun on 2 CPU ranks: the same logged
    losses, gradient norms, learning rates and eval metrics, and the same saved weights, bit for bit."""
    from safetensors.torch import load_file

    script = tmp_path / "genre_on_transformers.py"
    source = EXAMPLE.read_text().replace("from impel import EvalPrediction, Trainer, TrainingArguments, set_seed",
                                         "from transformers import EvalPrediction, Trainer, TrainingArguments, "
                                         "set_seed")
    assert "from impel import" not in source
    script.write_text(source)
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), *TINY, "--output_dir", str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=150, env=clean_env(tmp_path, ACCELERATE_USE_CPU="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "impel Trainer on 2 process(es) (MULTI_CPU), global batch 8" in proc.stdout

    def history(folder):
        rows = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        return [{k: v for k, v in row.items() if "runtime" not in k and "per_second" not in k} for row in rows]

    theirs = out / "checkpoint-2"
    assert history(checkpoint) == history(theirs) and len(history(theirs)) == 3  # 2 train rows, 1 eval
    ours, reference = load_file(checkpoint / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[name], reference[name]) for name in ours)


def test_genre_example_with_the_deepspeed_knob(tmp_path):
    """``--deepspeed zero2.json``: ZeRO-2 on 2 CPU ranks under transformers' loop; impel's callbacks write
    metrics.jsonl (what ``impel compare`` reads)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    # no MULTI_CPU config file: the knob chooses the strategy (a config file naming another one raises)
    res = impel(["launch", "--cpu", "--num_processes", "2", str(EXAMPLE),
                 "--max_steps", "2", "--train_per_class", "16", "--test_per_class", "6", "--batch_size", "4",
                 "--max_length", "24", "--eval_steps", "2", "--logging_steps", "1", "--output_dir", str(out),
                 "--disable_tqdm", "--cpu", "--deepspeed",
                 str(ROOT / "examples" / "configs" / "zero2.json")], tmp_path, timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    assert "Traceback" not in res.output
    accuracy = re.findall(r"^eval accuracy: ([0-9.]+) on 12 passages", res.stdout, flags=re.MULTILINE)
    assert len(accuracy) == 1 and 0.0 <= float(accuracy[0]) <= 1.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [2]
