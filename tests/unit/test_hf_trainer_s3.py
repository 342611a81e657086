"""The Trainer's ``output_dir`` on object storage (impel.trainer.hf_remote), against a real S3 API server (moto in
server mode, s3fs as the client): checkpoints uploaded with impel's marker last, rotated remotely, the outputs
uploaded, and ``"auto"`` resuming on a machine without the local copy from the newest complete remote checkpoint,
ending bitwise equal to the uninterrupted run."""
from __future__ import annotations

import os
import shutil

import pytest

from hf_trainer_helpers import padded_lm_data, tiny_gpt2

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

from s3_helpers import s3_server  # noqa: E402


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    with s3_server() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("IMPEL_STAGING_DIR", str(tmp_path / "staging"))
        s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches clients: this test's server, not an earlier one
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
        if not fs.exists("impel-trainer"):  # moto's state lives in this process, across servers
            fs.mkdir("impel-trainer")
        yield fs
        s3fs.S3FileSystem.clear_instance_cache()


def _trainer(output_dir, **kwargs):
    from impel.trainer.hf import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=5e-3, use_cpu=True, report_to=[], disable_tqdm=True,
                             save_strategy="steps", save_steps=2, seed=3, logging_steps=1, **kwargs)
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(), plot_loss=False)


def _names(fs, prefix):
    return sorted(str(p).rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False))


def test_checkpoints_go_to_s3_and_auto_resumes_from_the_newest_complete_one_bitwise(bucket, tmp_path, monkeypatch):
    from impel.trainer import hf_resume

    monkeypatch.chdir(tmp_path)
    full = _trainer("s3://impel-trainer/full", save_total_limit=2)
    full.train()
    full.save_model()
    assert full.output_url == "s3://impel-trainer/full" and not os.path.exists(tmp_path / "s3:")
    assert full.args.output_dir.startswith(str(tmp_path / "staging"))
    remote = _names(bucket, "impel-trainer/full")
    assert [n for n in remote if n.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-6"]  # 2 rotated away
    assert {"metrics.jsonl", "model.safetensors", "config.json"} <= set(remote)
    assert hf_resume.MARKER in _names(bucket, "impel-trainer/full/checkpoint-6")

    # another machine (no local copy) resumes a run whose upload of checkpoint-6 was cut short (no marker)
    shutil.rmtree(full.args.output_dir)
    bucket.rm_file(f"impel-trainer/full/checkpoint-6/{hf_resume.MARKER}")
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        taken: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.taken.append(state.global_step)

    resumed = _trainer("s3://impel-trainer/full", save_total_limit=2)
    resumed.add_callback(Steps())
    resumed.train(resume_from_checkpoint="auto")
    assert Steps.taken == [5, 6]  # from the remote checkpoint-4: checkpoint-6 was cut short
    assert os.path.isdir(os.path.join(resumed.args.output_dir, "checkpoint-4"))  # downloaded, then trained on
    difference = max((resumed.model.state_dict()[k] - full.model.state_dict()[k]).abs().max().item()
                     for k in full.model.state_dict())
    assert difference == 0.0
    assert hf_resume.MARKER in _names(bucket, "impel-trainer/full/checkpoint-6")  # uploaded again, whole


def test_true_without_a_remote_checkpoint_raises_and_a_url_without_the_marker_is_refused(bucket, tmp_path):
    from impel.config.run_config import ConfigError

    with pytest.raises(ValueError, match=r"No valid checkpoint found in output_dir \(s3://impel-trainer/none\)"):
        _trainer("s3://impel-trainer/none").train(resume_from_checkpoint=True)
    bucket.pipe("impel-trainer/other/checkpoint-2/trainer_state.json", b"{}")
    with pytest.raises(ConfigError, match=r"holds no impel_complete.json: not a checkpoint impel's Trainer uploaded"):
        _trainer("s3://impel-trainer/none").train(resume_from_checkpoint="s3://impel-trainer/other/checkpoint-2")
    assert _names(bucket, "impel-trainer/other/checkpoint-2") == ["trainer_state.json"]  # never deleted
