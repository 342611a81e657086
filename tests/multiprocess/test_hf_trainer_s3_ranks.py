"""The Trainer with an ``output_dir`` on S3 (moto's server) on 2 CPU ranks: the main process uploads, and a new
2-rank job on a "machine" without the local mirror resumes from the newest complete remote checkpoint (one rank per
machine downloads it), ending bitwise equal to the uninterrupted run."""
from __future__ import annotations

import pytest

from impel.testing import run_on_ranks

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

from s3_helpers import s3_server  # noqa: E402

TIMEOUT = 180
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2 * TIMEOUT + 60)]


def _train(url: str, resume: str | None) -> dict:
    from transformers import TrainerCallback

    from hf_trainer_helpers import padded_lm_data, tiny_gpt2
    from impel.trainer.hf import Trainer, TrainingArguments

    taken: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            taken.append(state.global_step)

    args = TrainingArguments(output_dir=url, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=5e-3, use_cpu=True, report_to=[], disable_tqdm=True,
                             save_strategy="steps", save_steps=2, save_total_limit=2, seed=3, logging_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(), plot_loss=False)
    trainer.add_callback(Steps())
    trainer.train(resume_from_checkpoint=resume)
    return {"steps": taken, "weights": {k: v.tolist() for k, v in trainer.model.state_dict().items()}}


def test_two_ranks_save_to_s3_and_resume_elsewhere_bitwise(monkeypatch, tmp_path):
    from impel.trainer.hf_resume import MARKER

    with s3_server() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        if not fs.exists("trainer-ranks"):
            fs.mkdir("trainer-ranks")
        first = {"IMPEL_STAGING_DIR": str(tmp_path / "machine-a")}
        full = run_on_ranks(_train, 2, args=("s3://trainer-ranks/run", None), env=first, timeout=TIMEOUT)
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("trainer-ranks/run", detail=False))
        assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-6"]
        fs.rm_file(f"trainer-ranks/run/checkpoint-6/{MARKER}")  # its upload cut short
        other = {"IMPEL_STAGING_DIR": str(tmp_path / "machine-b")}
        resumed = run_on_ranks(_train, 2, args=("s3://trainer-ranks/run", "auto"), env=other, timeout=TIMEOUT)
        for rank in range(2):
            assert resumed[rank]["steps"] == [5, 6], resumed[rank]["steps"]
            assert resumed[rank]["weights"] == full[rank]["weights"] == full[0]["weights"]
