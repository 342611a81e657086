"""The Trainer entry: transformers' ``Trainer`` running on impel's Accelerator.

Modules by job: ``hf`` (``Trainer``: transformers' Trainer with impel's Accelerator; transformers'
``TrainingArguments``, callbacks and state classes re-exported), ``hf_fields`` (what impel does with each
``TrainingArguments`` field, the generated docs table), ``hf_fsdp`` / ``hf_deepspeed`` (the ``fsdp`` and
``deepspeed`` knobs on impel's strategies), ``hf_callbacks`` (impel's additions: metrics.jsonl, loss.png, complete
checkpoints, auto-resume), ``hf_resume`` (which checkpoint a resume takes; what may be removed), ``hf_ref_model``
(TRL's synced reference model in the checkpoints), ``hf_remote`` (an ``output_dir`` on object storage: a local
mirror, uploads marker last, remote rotation and resume), ``plot`` (loss PNGs and ``metrics.jsonl`` reading, shared
with ``impel compare``), ``route`` (``on_impel(cls)``: any transformers Trainer subclass, e.g. TRL's trainers, on
impel's Accelerator). Names
resolve lazily, so ``import impel.trainer`` does not import transformers; using one without it raises
``ImportError`` naming ``pip install 'impel[transformers]'``.

Example::

    from impel import Trainer, TrainingArguments      # was: from transformers import Trainer, TrainingArguments

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", max_steps=100), train_dataset=train)
    trainer.train()
"""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {
    "Trainer": "hf", "TrainingArguments": "hf", "TrainerCallback": "hf", "EarlyStoppingCallback": "hf",
    "ProgressCallback": "hf", "default_data_collator": "hf", "get_scheduler": "hf", "EvalPrediction": "hf",
    "PredictionOutput": "hf", "TrainerControl": "hf", "TrainerState": "hf", "TrainOutput": "hf",
    "on_impel": "route",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
