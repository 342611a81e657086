"""``Trainer.predict`` on 2 CPU ranks: every sample once, in order, equal to one process and to the predictions
``evaluate()`` gathers with ``gather_for_metrics``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from impel.testing import run_on_ranks
from trainer_helpers import TokenDataset, tiny_bert

pytestmark = pytest.mark.multiprocess


def _predict(output_dir: str):
    from impel import Trainer, TrainingArguments

    seen = []

    def metrics(pred):
        seen.append(pred.predictions.copy())
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean()),
                "n": len(pred.label_ids)}

    # 11 samples, 3 per rank and batch: the ranks' last batches are padded by even_batches, then dropped again
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_eval_batch_size=3, disable_tqdm=True,
                             report_to="none")
    data = TokenDataset(11, seed=2)
    trainer = Trainer(tiny_bert(), args, eval_dataset=data, compute_metrics=metrics)
    output = trainer.predict(data)
    evaluated = trainer.evaluate()
    return {"predictions": output.predictions, "label_ids": output.label_ids, "metrics": output.metrics,
            "evaluated": evaluated, "gathered_by_evaluate": seen[-1],
            "processes": trainer.accelerator.num_processes}


def _stable(metrics):
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}


def test_predict_on_two_ranks_equals_one_process(tmp_path):
    ranks = run_on_ranks(_predict, 2, args=(str(tmp_path / "ranks"),), timeout=120)
    one = _predict(str(tmp_path / "one"))
    data = TokenDataset(11, seed=2)
    with torch.no_grad():
        logits = tiny_bert().eval()(input_ids=data.ids, attention_mask=torch.ones_like(data.ids)).logits.numpy()
    assert one["processes"] == 1 and [r["processes"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["predictions"].shape == (11, 2)  # each sample once: the even-batches duplicates are gone
        assert np.abs(r["predictions"] - one["predictions"]).max() <= 1e-6
        assert np.abs(r["predictions"] - logits).max() <= 1e-5  # and in the dataset's order
        assert r["label_ids"].tolist() == one["label_ids"].tolist() == data.labels.tolist()
        assert np.array_equal(r["predictions"], r["gathered_by_evaluate"])  # what evaluate() gathered, exactly
        assert _stable(r["metrics"]).keys() == {"test_loss", "test_accuracy", "test_n"}
        assert r["metrics"]["test_n"] == 11
        # the loss is each batch's mean counted once per sample (as in transformers): a rank's last batch, padded
        # with samples from the start, averages their losses in before the copies are dropped (0.69342 vs 0.69353)
        assert r["metrics"]["test_loss"] == pytest.approx(one["metrics"]["test_loss"], abs=1e-3)
        assert r["metrics"]["test_accuracy"] == one["metrics"]["test_accuracy"]
        assert r["evaluated"]["eval_loss"] == pytest.approx(r["metrics"]["test_loss"], abs=1e-12)
    assert _stable(ranks[0]["metrics"]) == _stable(ranks[1]["metrics"])
