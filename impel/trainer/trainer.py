"""``Trainer``: transformers' training loop, built on the Accelerator only.

The Trainer turns ``TrainingArguments`` into ``Accelerator(...)`` arguments (FSDP and DeepSpeed as plugins,
checkpoints as a ``ProjectConfiguration``), prepares the model, an AdamW optimizer, the dataloaders and a
schedule, and runs the loop every impel script would: ``accumulate`` / ``backward`` / clip at sync steps /
``step``. Which strategy runs it is the launch config's and the arguments' business, never the Trainer's.

Example::

    args = TrainingArguments(output_dir="out", max_steps=100, eval_strategy="steps", eval_steps=25)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=test, compute_metrics=accuracy)
    trainer.train()
    print(trainer.evaluate()["eval_accuracy"])
    predictions, label_ids, metrics = trainer.predict(test)
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from impel.accelerator.facade import Accelerator
from impel.config.run_config import ConfigError
from impel.runtime.seeding import set_seed
from impel.trackers.registry import Tracker, check_installed, make_trackers
from impel.trainer.arguments import TrainingArguments
from impel.trainer.best_model import (
    keep_only_best,
    load_best_model,
    next_checkpoint_path,
    note_save,
    rotate_checkpoints,
    update_best,
)
from impel.trainer.callbacks import CallbackHandler, TrainerCallback, export_states, restore_states
from impel.trainer.collate import default_data_collator, padding_collator, remove_unused_columns
from impel.trainer.distributed import accelerator_kwargs, deepspeed_sections
from impel.trainer.evaluation import EvalLoopOutput, evaluate_batches, model_loss
from impel.trainer.optimization import parameter_groups
from impel.trainer.plot import write_loss_plot
from impel.trainer.progress import ProgressCallback, format_summary
from impel.trainer.schedules import get_scheduler, plan_steps
from impel.trainer.state import EvalPrediction, PredictionOutput, TrainerControl, TrainerState, TrainOutput

logger = logging.getLogger("impel")

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class Trainer:
    """Train and evaluate a model (anything returning ``.loss`` from ``model(**batch)``) with impel.

    ``optimizers=(optimizer, scheduler)`` replaces the default AdamW + ``lr_scheduler_type`` schedule.
    ``compute_metrics(EvalPrediction) -> dict`` adds metrics to ``evaluate()``. ``processing_class`` (a tokenizer
    with ``pad``) supplies a padding collator when ``data_collator`` is not given. ``callbacks`` are impel's or
    transformers' ``TrainerCallback`` classes or instances (see :mod:`impel.trainer.callbacks`).
    """

    _grad_norm: torch.Tensor | None  # the last clip's norm (set in train(), read at logging time)

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None,
                 data_collator: Callable[[list[Any]], Any] | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
                 callbacks: Iterable[TrainerCallback | type] | None = None,
                 optimizers: tuple[Any, Any] = (None, None)) -> None:
        if model is None:
            raise ConfigError("Trainer(model=None): pass the model to train")
        self.args = args if args is not None else TrainingArguments()
        if self.args.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError(f"eval_strategy={self.args.eval_strategy!r} needs an eval_dataset; pass one or set "
                              "eval_strategy='no'")
        check_installed(self.args.trackers)  # on every rank, before any process group work
        self.accelerator = Accelerator(**accelerator_kwargs(self.args))
        set_seed(self.args.seed)
        self.model = model
        self.label_names = list(self.args.label_names or ["labels"])
        if self.args.remove_unused_columns:
            train_dataset = remove_unused_columns(train_dataset, model, self.label_names, "training")
            eval_dataset = remove_unused_columns(eval_dataset, model, self.label_names, "evaluation")
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        if data_collator is None:
            pads = processing_class is not None and callable(getattr(processing_class, "pad", None))
            data_collator = padding_collator(processing_class) if pads else default_data_collator
        self.data_collator = data_collator
        self.processing_class = processing_class
        self.compute_metrics = compute_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.state = TrainerState(is_world_process_zero=self.accelerator.is_main_process,
                                  is_local_process_zero=self.accelerator.is_local_main_process)
        self.control = TrainerControl()
        # transformers' order: the user's callbacks, then the progress display
        self.callback_handler = CallbackHandler([*(callbacks or ()), ProgressCallback()])
        self.trackers: list[Tracker] = []
        self.train_dataloader: Any = None
        self.eval_dataloader: Any = None
        self._prepared = False
        self._window = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)  # loss sum, count
        self._event("on_init_end")

    # --- callbacks and logging ------------------------------------------------------------------------------
    def _event(self, name: str, **kwargs: Any) -> None:
        self.control = self.callback_handler.call(
            name, self.args, self.state, self.control, model=self.model, processing_class=self.processing_class,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, train_dataloader=self.train_dataloader,
            eval_dataloader=self.eval_dataloader, **kwargs)

    def add_callback(self, callback: TrainerCallback | type) -> None:
        """Add a callback (a class is instantiated)."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        """Remove and return the callback (the first of a class); None when there is none."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback: TrainerCallback | type) -> None:
        """Remove the callback (the first of a class)."""
        self.callback_handler.remove(callback)

    def _open_trackers(self) -> None:
        """(Re)open the sinks; metrics.jsonl is rewritten from the log history (a resume's history)."""
        for tracker in self.trackers:
            tracker.finish()
        args = self.args
        self.trackers = make_trackers(args.trackers, self.accelerator.logging_dir or self._output_dir, args.run_name,
                                      args.to_dict(), self.accelerator.is_main_process,
                                      jsonl_path=os.path.join(self._output_dir, METRICS_FILE),
                                      history=self.state.log_history)

    def log(self, logs: dict[str, float]) -> None:
        """Record metrics (every rank calls it with the same values): log history, trackers, ``on_log``."""
        row = {**logs, "epoch": round(self.state.epoch, 4), "step": self.state.global_step}
        self.state.log_history.append(row)
        if not self.trackers and self.accelerator.is_main_process:
            self._open_trackers()
        else:
            for tracker in self.trackers:
                tracker.log({k: v for k, v in row.items() if k != "step"}, self.state.global_step)
        self._event("on_log", logs=row)

    # --- data -----------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """Shuffled (seeded by ``args.seed``) per-rank batches of ``per_device_train_batch_size``."""
        if self.train_dataset is None:
            raise ConfigError("Trainer.train() needs a train_dataset")
        iterable = isinstance(self.train_dataset, IterableDataset)
        return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                          shuffle=not iterable, collate_fn=self.data_collator,
                          num_workers=self.args.dataloader_num_workers, drop_last=self.args.dataloader_drop_last,
                          generator=None if iterable else torch.Generator().manual_seed(self.args.seed))

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """In-order per-rank batches of ``per_device_eval_batch_size`` (the last one is never dropped)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigError("evaluate() needs an eval_dataset (pass it to Trainer or to evaluate())")
        return DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, shuffle=False,
                          collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers)

    # --- optimizer, schedule, prepare -----------------------------------------------------------------------
    def create_optimizer(self) -> torch.optim.Optimizer:
        """AdamW with ``learning_rate``, ``adam_*`` and ``weight_decay`` (not on biases and norm weights); when a
        DeepSpeed JSON defines its ``optimizer``, DeepSpeed's placeholder carrying the same values."""
        args = self.args
        groups = parameter_groups(self.model, args.weight_decay)
        betas = (args.adam_beta1, args.adam_beta2)
        if "optimizer" in deepspeed_sections(args):
            from impel import DummyOptim

            return DummyOptim(groups, lr=args.learning_rate, weight_decay=args.weight_decay, betas=betas,
                              eps=args.adam_epsilon)
        return torch.optim.AdamW(groups, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer) -> Any:
        """``lr_scheduler_type`` with warmup; DeepSpeed's placeholder when its JSON defines the ``scheduler``."""
        warmup = self.args.warmup_for(num_training_steps)
        if "scheduler" in deepspeed_sections(self.args):
            from impel import DummyScheduler

            return DummyScheduler(optimizer, total_num_steps=num_training_steps, warmup_num_steps=warmup)
        return get_scheduler(self.args.lr_scheduler_type, optimizer, warmup, num_training_steps)

    def _setup(self) -> None:
        """Prepare everything once, in a fixed order (checkpoints pair prepared objects by order)."""
        if self._prepared:
            return
        acc = self.accelerator
        if self.train_dataset is not None:
            self.train_dataloader = acc.prepare(self.get_train_dataloader())
            plan_steps(self.args, self.state, self.train_dataloader, acc.gradient_accumulation_steps,
                       acc.num_processes)
            optimizer = self.optimizer if self.optimizer is not None else self.create_optimizer()
            scheduler = self.lr_scheduler
            if scheduler is None:
                scheduler = self.create_scheduler(self.state.max_steps, optimizer)
            self.model, self.optimizer, self.lr_scheduler = acc.prepare(self.model, optimizer, scheduler)
        else:
            self.model = acc.prepare(self.model)
        if self.eval_dataset is not None:
            self.eval_dataloader = acc.prepare(self.get_eval_dataloader())
        acc.register_for_checkpointing(self.state)
        self._prepared = True

    # --- training -------------------------------------------------------------------------------------------
    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False) -> Any:
        """``model(**inputs)``'s loss; override for custom losses (return ``(loss, outputs)`` when asked)."""
        if not isinstance(inputs, Mapping):
            raise ConfigError(f"the Trainer calls model(**batch), but a batch is a {type(inputs).__name__}; make the "
                              "dataset or data_collator return dicts (e.g. {'input_ids': ..., 'labels': ...}) or "
                              "subclass Trainer and override compute_loss")
        outputs = model(**inputs)
        loss = model_loss(outputs, loss_first=any(n in inputs for n in self.label_names))
        if loss is None:
            raise ConfigError(f"{type(self.accelerator.unwrap_model(model)).__name__} returned no loss; put the labels "
                              f"in the batch (keys {self.label_names}) or override Trainer.compute_loss")
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """One micro-step: forward, backward (divided by the accumulation group's length), clip at sync, step."""
        acc, args = self.accelerator, self.args
        with acc.accumulate(model):
            loss = self.compute_loss(model, inputs)
            acc.backward(loss)
            if acc.sync_gradients:
                if args.max_grad_norm:
                    # read at logging time: no device sync per step, and DeepSpeed fills it during step()
                    self._grad_norm = acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                self._event("on_pre_optimizer_step")
            self.optimizer.step()  # a no-op mid-group
            if acc.sync_gradients:
                self._event("on_optimizer_step")
            self.lr_scheduler.step()
            self.optimizer.zero_grad()
        return loss.detach()

    def train(self, resume_from_checkpoint: str | os.PathLike[str] | bool | None = None) -> TrainOutput:
        """Train for ``max_steps`` (or ``num_train_epochs``); ``resume_from_checkpoint`` = a checkpoint directory
        or True (the newest under ``output_dir/checkpoints``) continues exactly where that checkpoint was saved."""
        resume = self.args.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint
        self._setup()
        acc, state = self.accelerator, self.state
        if self.train_dataloader is None:
            raise ConfigError("Trainer.train() needs a train_dataset")
        resumed = None
        if resume:
            resumed = acc.load_state(None if resume is True else os.fspath(resume))
        else:  # `impel launch --auto_resume`: resume before the loop is planned
            resumed = acc.resume_from_auto_checkpoint()
        if resumed:
            self._after_resume(resumed)
        self._open_trackers()
        self.control = TrainerControl()
        self._grad_norm = None
        self._empty_passes = 0
        started, start_step, start_samples = time.perf_counter(), state.global_step, state.samples_seen
        self._event("on_train_begin")
        if self.args.eval_on_start:  # transformers' sanity check: one evaluation before the first step
            if self.eval_dataloader is None:
                raise ConfigError("eval_on_start=True needs an eval_dataset; pass one to the Trainer")
            self.evaluate()
        self.model.train()
        while state.global_step < state.max_steps and not self.control.should_training_stop:
            self._train_epoch()
        runtime = time.perf_counter() - started
        metrics = self._final_metrics(runtime, state.global_step - start_step, state.samples_seen - start_samples)
        if self.args.load_best_model_at_end and state.best_model_checkpoint is not None:
            load_best_model(acc, self.model, state.best_model_checkpoint)
        if self.args.save_total_limit == 1:
            keep_only_best(state, acc, self.args.save_on_each_node)
        self._event("on_train_end")
        self._finish(metrics)
        return TrainOutput(state.global_step, metrics["train_loss"], metrics)

    def _after_resume(self, checkpoint: str) -> None:
        """Settle what a restored TrainerState refers to (transformers forgets a best checkpoint gone from disk)."""
        state = self.state
        state.last_checkpoint = checkpoint
        self._window = torch.tensor([state.loss_sum, state.loss_count], dtype=torch.float64,
                                    device=self.accelerator.device)
        state.checkpoints = {step: path for step, path in state.checkpoints.items() if os.path.isdir(path)}
        if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
            logger.warning("the best checkpoint %s recorded in the resumed state does not exist anymore; ignoring it",
                           state.best_model_checkpoint)
            state.best_model_checkpoint = None
        if self.args.restore_callback_states_from_checkpoint:
            restore_states(self.callback_handler.callbacks, state.stateful_callbacks)

    def _train_epoch(self) -> None:
        loader, state = self.train_dataloader, self.state
        self._event("on_epoch_begin")
        batches = 0
        per_step = self.args.per_device_train_batch_size * self.accelerator.num_processes
        for batch in loader:
            batches += 1
            if self.accelerator.gradient_state.micro_in_group == 0:
                self._event("on_step_begin")
            loss = self.training_step(self.model, batch)
            self._window += torch.stack([loss.double().to(self._window.device), self._window.new_ones(())])
            state.samples_seen += per_step
            if self.accelerator.sync_gradients:
                state.global_step += 1
                state.epoch = self._epoch_progress(loader)
                self._after_step()
            else:
                self._event("on_substep_end")
            if self.control.should_training_stop:
                break
            if self.control.should_epoch_stop:  # a callback ends this epoch early: the next pass is a new epoch
                loader.set_epoch(loader.epoch + 1)
                break
        # a resume from a checkpoint taken on an epoch's last batch replays an empty rest of that epoch, once
        self._empty_passes = 0 if batches else self._empty_passes + 1
        if self._empty_passes > 1:
            raise ConfigError("the training dataloader produced no batches (an empty train_dataset, or "
                              "dataloader_drop_last=True with fewer samples than one global batch)")
        state.epoch = self._epoch_progress(loader)
        control = self.control
        control.should_log = control.should_log or self.args.logging_strategy == "epoch"
        control.should_evaluate = control.should_evaluate or (self.args.eval_strategy == "epoch"
                                                              and self.args.eval_delay <= state.epoch)
        control.should_save = control.should_save or self.args.save_strategy == "epoch"
        self._event("on_epoch_end")
        self._act()

    def _epoch_progress(self, loader: Any) -> float:
        try:
            return loader.epoch + loader.position / max(1, len(loader))
        except TypeError:
            return float(loader.epoch)

    def _after_step(self) -> None:
        """transformers' DefaultFlowCallback (it runs first, so later callbacks see its flags), then act."""
        args, state, control = self.args, self.state, self.control
        step, last = state.global_step, state.global_step >= state.max_steps
        if (args.logging_strategy == "steps" and (step % state.logging_steps == 0 or last)) or (
                args.logging_first_step and step == 1):
            control.should_log = True
        if args.eval_strategy == "steps" and (step % state.eval_steps == 0 or last) and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and (step % state.save_steps == 0 or last):
            control.should_save = True
        control.should_training_stop = control.should_training_stop or last
        self._event("on_step_end")
        self._act()

    def _act(self) -> None:
        """Log, evaluate (and track the best metric), save, as ``control`` says after the callbacks had their say."""
        if self.control.should_log:
            self._log_window()
        if self.control.should_evaluate and self.eval_dataloader is not None:
            is_best = update_best(self.args, self.state, self.evaluate())
            if self.args.save_strategy == "best":
                self.control.should_save = is_best
        if self.control.should_save:
            self._save_checkpoint()
        self.control.reset_step()

    def _window_loss(self) -> float | None:
        """The loss averaged over every rank's micro-steps since the last log (None when there were none)."""
        window = self.accelerator.reduce(self._window, "sum")
        return float(window[0] / window[1]) if window[1] > 0 else None

    def _log_window(self) -> None:
        loss = self._window_loss()
        self._window.zero_()
        if loss is None:
            return
        logs: dict[str, float] = {"loss": loss}
        if self._grad_norm is not None:
            logs["grad_norm"] = float(self._grad_norm)
        logs["learning_rate"] = float(self.lr_scheduler.get_last_lr()[0])
        self.log(logs)

    def _save_checkpoint(self) -> None:
        """``save_state`` with the TrainerState inside already naming this checkpoint (and the best), then
        rotation that keeps the newest and the best."""
        acc, state = self.accelerator, self.state
        window = acc.reduce(self._window, "mean")  # the unlogged window, the same on every rank
        state.loss_sum, state.loss_count = float(window[0]), round(float(window[1]))
        note_save(state, next_checkpoint_path(acc))
        state.stateful_callbacks = export_states(self.callback_handler.callbacks)
        state.last_checkpoint = acc.save_state(async_save=False)  # rotation below reads the committed one
        rotate_checkpoints(state, acc, self.args.save_total_limit, self.args.save_on_each_node)
        self._event("on_save")

    def _final_metrics(self, runtime: float, steps: int, samples: int) -> dict[str, float]:
        losses = [row["loss"] for row in self.state.log_history if "loss" in row]
        if not losses:  # logging_strategy="no": the mean over every micro-step, from the never-logged window
            losses = [loss] if (loss := self._window_loss()) is not None else []
        metrics = {"train_runtime": round(runtime, 3),
                   "train_samples_per_second": round(samples / runtime, 3) if runtime > 0 else 0.0,
                   "train_steps_per_second": round(steps / runtime, 3) if runtime > 0 else 0.0,
                   "train_loss": sum(losses) / len(losses) if losses else float("nan")}
        self.log(dict(metrics))
        return metrics

    def _finish(self, metrics: dict[str, float]) -> None:
        """On the main process: ``output_dir/loss.png`` (as ``args.plot_loss`` says) and the summary."""
        if self.accelerator.is_main_process:
            out = self._output_dir
            plot_path = write_loss_plot(self.state.log_history, os.path.join(out, PLOT_FILE), self.args.plot_loss)
            print(format_summary(self.state, self.accelerator, metrics, os.path.join(out, METRICS_FILE), plot_path),
                  flush=True)
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.accelerator.wait_for_everyone()

    # --- evaluation -----------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss (and ``compute_metrics``) over the whole eval set, gathered from every rank; logged and returned."""
        self._setup()
        if eval_dataset is None and self.eval_dataloader is None:
            raise ConfigError("evaluate() needs an eval_dataset (pass it to Trainer or to evaluate())")
        with self._loader_for(eval_dataset) as loader:
            metrics = self.evaluation_loop(loader, "Evaluation", ignore_keys=ignore_keys,
                                           metric_key_prefix=metric_key_prefix).metrics
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions over ``test_dataset``, gathered from every rank (each sample once, in order): transformers'
        ``PredictionOutput(predictions, label_ids, metrics)``; metrics (``test_loss``, ``compute_metrics``) need
        labels in the data. Not logged; callbacks get ``on_predict``."""
        self._setup()
        with self._loader_for(test_dataset) as loader:
            output = self.evaluation_loop(loader, "Prediction", prediction_loss_only=False, ignore_keys=ignore_keys,
                                          metric_key_prefix=metric_key_prefix)
        self._event("on_predict", metrics=output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, output.metrics)

    @contextlib.contextmanager
    def _loader_for(self, dataset: Any) -> Iterator[Any]:
        """The prepared eval loader, or a one-off loader for ``dataset`` that is not kept in the checkpointed
        state afterwards."""
        if dataset is None:
            yield self.eval_dataloader
            return
        acc = self.accelerator
        if self.args.remove_unused_columns:
            dataset = remove_unused_columns(dataset, acc.unwrap_model(self.model), self.label_names, "evaluation")
        loader = acc.prepare(self.get_eval_dataloader(dataset))
        try:
            yield loader
        finally:  # a one-off loader must not become part of the checkpointed state
            acc.prepared.forget(loader)

    def evaluation_loop(self, dataloader: Any, description: str = "Evaluation",
                        prediction_loss_only: bool | None = None, ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Metrics (and, unless ``prediction_loss_only``, gathered predictions and labels) over one prepared loader;
        see :func:`impel.trainer.evaluation.evaluate_batches`. ``prediction_loss_only=None``: gather predictions only
        when there is a ``compute_metrics``. ``ignore_keys`` default: the model config's
        ``keys_to_ignore_at_inference``."""

        def forward(batch: Any, has_labels: bool) -> tuple[Any, Any]:
            if has_labels:
                return self.compute_loss(self.model, batch, return_outputs=True)
            return None, self.model(**batch)

        if ignore_keys is None:
            config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", None) or [])
        collect = None if prediction_loss_only is None else not prediction_loss_only
        return evaluate_batches(self.accelerator, self.model, dataloader, forward, self.label_names,
                                self.compute_metrics, metric_key_prefix, collect=collect, ignore_keys=ignore_keys,
                                on_batch=lambda: self._event("on_prediction_step"))

    # --- saving ---------------------------------------------------------------------------------------------
    @property
    def _output_dir(self) -> str:
        out = self.args.output_dir
        assert out is not None  # TrainingArguments.__post_init__ makes it a string ("trainer_output" by default)
        return out

    def save_model(self, output_dir: str | os.PathLike[str] | None = None) -> str:
        """Full weights (``model.safetensors``) plus the model's config and the processing class, if they can
        ``save_pretrained``; collective. Returns the directory."""
        directory = os.fspath(output_dir) if output_dir is not None else self._output_dir
        self._setup()
        self.accelerator.save_model(self.model, directory)
        if self.accelerator.is_main_process:
            inner = self.accelerator.unwrap_model(self.model)
            for owner in (getattr(inner, "config", None), self.processing_class):
                if owner is not None and callable(getattr(owner, "save_pretrained", None)):
                    owner.save_pretrained(directory)
        self.accelerator.wait_for_everyone()
        return directory
