"""What the Trainer knows about the run: counters and the log history (checkpointed), and its outputs.

``TrainerState`` is registered with ``accelerator.register_for_checkpointing``: ``state_dict`` is plain data
(numbers, strings, lists, dicts), so it loads back with ``torch.load(weights_only=True)``.

Example::

    state = TrainerState(max_steps=100)
    state.global_step += 1
    state.log_history.append({"step": 1, "loss": 0.69})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

_SAVED = ("global_step", "epoch", "log_history", "samples_seen", "loss_sum", "loss_count", "best_metric",
          "best_global_step", "best_model_checkpoint", "checkpoints", "stateful_callbacks")


@dataclass
class TrainerState:
    """Counters of a run. ``epoch`` is fractional (2.5 = half-way through the third epoch); ``samples_seen`` counts
    training samples over all ranks; ``loss_sum`` / ``loss_count`` are the logging window not yet logged.

    ``best_metric`` / ``best_global_step`` / ``best_model_checkpoint`` are transformers' (set when
    ``metric_for_best_model`` is); ``checkpoints`` maps the optimizer step of each kept checkpoint to its directory;
    ``stateful_callbacks`` holds callbacks' ``state()`` at the last save (transformers' ``ExportableState``)."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    steps_per_epoch: int | None = None
    train_batch_size: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    log_history: list[dict[str, Any]] = field(default_factory=list)
    samples_seen: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True
    last_checkpoint: str | None = None
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    checkpoints: dict[int, str] = field(default_factory=dict)
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SAVED}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in _SAVED:
            if name in state:
                setattr(self, name, state[name])
        self.log_history = [dict(row) for row in self.log_history]
        self.checkpoints = {int(step): path for step, path in self.checkpoints.items()}


@dataclass
class TrainerControl:
    """Decisions for the current step (transformers' names); callbacks may change them, or return a new one.

    Every rank runs the callbacks, and every rank must reach the same decisions (they drive collectives).
    ``should_training_stop`` is cleared at ``on_train_begin``, ``should_epoch_stop`` at ``on_epoch_begin``, the
    other three at ``on_step_begin`` and when their action (``on_log`` / ``on_evaluate`` / ``on_save``) happens.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_log: bool = False
    should_evaluate: bool = False
    should_save: bool = False

    def reset_step(self) -> None:
        self.should_log = self.should_evaluate = self.should_save = False

    # transformers' names, for callbacks written against its TrainerControl
    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.reset_step()

    def state(self) -> dict[str, Any]:
        return {"args": {k: getattr(self, k) for k in ("should_training_stop", "should_epoch_stop", "should_save",
                                                        "should_evaluate", "should_log")}, "attributes": {}}


class TrainOutput(NamedTuple):
    """What ``Trainer.train()`` returns, as in transformers."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class PredictionOutput(NamedTuple):
    """What ``Trainer.predict()`` returns, as in transformers: gathered numpy ``predictions``, ``label_ids`` (None
    without labels) and ``metrics`` (``test_loss``, ``compute_metrics``' values, speed; prefixed ``test_``)."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None


class EvalPrediction:
    """``compute_metrics``' argument: gathered ``predictions`` and ``label_ids`` (numpy arrays, duplicates that
    even batches added dropped). It also unpacks: ``logits, labels = eval_pred``.

    Example::

        def compute_metrics(p: EvalPrediction) -> dict[str, float]:
            return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}
    """

    def __init__(self, predictions: np.ndarray | tuple[np.ndarray, ...] | None, label_ids: np.ndarray | None) -> None:
        self.predictions = predictions
        self.label_ids = label_ids

    def __iter__(self) -> Any:
        return iter((self.predictions, self.label_ids))

    def __getitem__(self, index: int) -> Any:
        return (self.predictions, self.label_ids)[index]

    def __len__(self) -> int:
        return 2
