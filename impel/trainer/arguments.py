"""``TrainingArguments``: the knobs people know from transformers, validated when built.

Every check raises :class:`impel.config.run_config.ConfigError` naming the value and the fix. Knobs that the launch
config
also has (``bf16``/``fp16``, ``gradient_accumulation_steps``, ``use_cpu``, ``fsdp``, ``deepspeed``) mean "not set"
at their defaults, so a launched config decides them; set, they must agree with it (the Accelerator checks).

Example::

    args = TrainingArguments(output_dir="runs/genre", per_device_train_batch_size=16, learning_rate=5e-5,
                             max_steps=200, eval_strategy="steps", eval_steps=50, bf16=True)
"""
from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from impel.config.run_config import ConfigError, did_you_mean

SCHEDULER_TYPES = ("linear", "cosine", "constant", "constant_with_warmup")
INTERVALS = ("no", "steps", "epoch")
SAVE_STRATEGIES = INTERVALS + ("best",)
TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass
class TrainingArguments:
    """Training knobs with transformers' names and defaults (``gradient_accumulation_steps`` defaults to None:
    the launch config's value, else 1). ``*_steps`` knobs given as a float in (0, 1) are a share of the total
    optimizer steps, as in transformers. ``plot_loss`` is impel's: None writes ``loss.png`` when matplotlib is
    installed, True requires it, False skips it. ``load_best_model_at_end`` / ``metric_for_best_model`` /
    ``greater_is_better`` / ``save_strategy="best"`` follow transformers (metric "loss" by default, lower is better
    for names ending in "loss").

    Example::

        TrainingArguments(output_dir="out", fsdp="full_shard auto_wrap", fsdp_config={"offload_params": False})
    """

    output_dir: str | None = None
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    bf16: bool = False
    fp16: bool = False
    use_cpu: bool = False
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    logging_dir: str | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    eval_on_start: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_on_each_node: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    restore_callback_states_from_checkpoint: bool = False
    seed: int = 42
    data_seed: int | None = None
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    report_to: Any = "none"
    run_name: str | None = None
    resume_from_checkpoint: Any = None
    disable_tqdm: bool | None = None
    plot_loss: bool | None = None
    fsdp: Any = None
    fsdp_config: Any = None
    deepspeed: Any = None
    trackers: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.output_dir = os.fspath(self.output_dir) if self.output_dir is not None else "trainer_output"
        if self.logging_dir is not None:
            self.logging_dir = os.fspath(self.logging_dir)
        self._check_sizes()
        self._check_optimizer()
        self._check_schedule()
        self._check_intervals()
        self._check_switches()
        self._check_best_model()
        self.trackers = resolve_report_to(self.report_to)
        from impel.trainer.distributed import check_distributed_arguments

        check_distributed_arguments(self)  # fsdp / fsdp_config / deepspeed parse now, so errors come early

    # --- checks ---------------------------------------------------------------------------------------------
    def _check_sizes(self) -> None:
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            _integer(name, getattr(self, name), minimum=1)
        if self.gradient_accumulation_steps is not None:
            _integer("gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1,
                     fix="or None (the launch config's value, else 1)")
        _integer("max_steps", self.max_steps, minimum=-1, fix="(-1: train for num_train_epochs)")
        if self.max_steps == 0:
            raise ConfigError("max_steps=0 trains nothing; use a positive number, or -1 to train for num_train_epochs")
        if self.max_steps < 0:
            _number("num_train_epochs", self.num_train_epochs, low=0.0, open_low=True)
        _integer("seed", self.seed, minimum=0)
        if self.data_seed is not None:
            _integer("data_seed", self.data_seed, minimum=0, fix="or None (the shuffle follows seed)")
        _integer("dataloader_num_workers", self.dataloader_num_workers, minimum=0)
        if self.save_total_limit is not None:
            _integer("save_total_limit", self.save_total_limit, minimum=1, fix="or None (keep every checkpoint)")
        if self.label_names is not None and (isinstance(self.label_names, str)
                                             or not all(isinstance(n, str) for n in self.label_names)):
            raise ConfigError(f"label_names={self.label_names!r} must be a list of column names, e.g. ['labels']")

    def _check_optimizer(self) -> None:
        _number("learning_rate", self.learning_rate, low=0.0)
        _number("weight_decay", self.weight_decay, low=0.0)
        for name in ("adam_beta1", "adam_beta2"):
            _number(name, getattr(self, name), low=0.0, high=1.0)
            if getattr(self, name) >= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be below 1 (e.g. 0.9 or 0.999)")
        _number("adam_epsilon", self.adam_epsilon, low=0.0, open_low=True)
        if self.max_grad_norm is not None:
            _number("max_grad_norm", self.max_grad_norm, low=0.0, fix="(0 or None: no clipping)")

    def _check_schedule(self) -> None:
        self.lr_scheduler_type = _choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULER_TYPES)
        _number("warmup_steps", self.warmup_steps, low=0.0,
                fix="(an integer number of steps, or a float in (0, 1) for a share of the total)")
        if self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps):
            raise ConfigError(f"warmup_steps={self.warmup_steps!r} must be a whole number of steps, or a float in "
                              "(0, 1) for a share of the total steps")
        _number("warmup_ratio", self.warmup_ratio, low=0.0, high=1.0)
        if self.warmup_steps and self.warmup_ratio:
            raise ConfigError(f"warmup_steps={self.warmup_steps!r} and warmup_ratio={self.warmup_ratio!r} are both "
                              "set; set only one of them")

    def _check_intervals(self) -> None:
        self.logging_strategy = _choice("logging_strategy", self.logging_strategy, INTERVALS)
        self.eval_strategy = _choice("eval_strategy", self.eval_strategy, INTERVALS)
        _number("eval_delay", self.eval_delay, low=0.0, fix="(epochs with eval_strategy='epoch', else steps)")
        self.save_strategy = _choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        _steps("logging_steps", self.logging_steps)
        _steps("save_steps", self.save_steps)
        if self.eval_steps is not None:
            _steps("eval_steps", self.eval_steps)

    def _check_switches(self) -> None:
        for name in ("bf16", "fp16", "use_cpu", "dataloader_drop_last", "remove_unused_columns", "logging_first_step",
                     "save_on_each_node", "load_best_model_at_end", "restore_callback_states_from_checkpoint",
                     "eval_on_start"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("disable_tqdm", "plot_loss"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True, False or None")
        if self.bf16 and self.fp16:
            raise ConfigError("bf16=True and fp16=True are both set; choose one mixed-precision mode")
        resume = self.resume_from_checkpoint
        if resume is not None and not isinstance(resume, (bool, str, os.PathLike)):
            raise ConfigError(f"resume_from_checkpoint={resume!r} must be a checkpoint directory, True (the newest "
                              "under output_dir/checkpoints) or None")

    def _check_best_model(self) -> None:
        """transformers' rules: the metric defaults to "loss" with load_best_model_at_end, greater_is_better to
        "the name does not end in loss"; a best checkpoint to load needs saves that line up with evaluations."""
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and not isinstance(self.metric_for_best_model, str):
            raise ConfigError(f"metric_for_best_model={self.metric_for_best_model!r} must be a metric name, e.g. "
                              "'loss' or 'eval_accuracy'")
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.greater_is_better not in (None, True, False):
            raise ConfigError(f"greater_is_better={self.greater_is_better!r} must be True, False or None")
        if (self.save_strategy == "best" or self.load_best_model_at_end) and self.metric_for_best_model is None:
            raise ConfigError("save_strategy='best' needs metric_for_best_model (e.g. 'loss' or 'accuracy'): "
                              "`args.metric_for_best_model` must be provided when using 'best' save_strategy")
        if not self.load_best_model_at_end or self.save_strategy == "best":
            return
        if self.eval_strategy != self.save_strategy:
            raise ConfigError("load_best_model_at_end requires the save and eval strategy to match, except when "
                              f"save_strategy='best', but found eval_strategy={self.eval_strategy!r}, save_strategy="
                              f"{self.save_strategy!r}; set both to 'steps' or both to 'epoch'")
        eval_steps = self.eval_steps if self.eval_steps is not None else self.logging_steps
        if self.eval_strategy == "steps" and not _multiple(self.save_steps, eval_steps):
            raise ConfigError(f"load_best_model_at_end requires the saving steps to be a round multiple of the "
                              f"evaluation steps, but found save_steps={self.save_steps!r}, eval_steps={eval_steps!r}"
                              "; make save_steps a multiple of eval_steps (both steps, or both ratios)")

    # --- derived values -------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str | None:
        """"bf16", "fp16", or None (not set here: the launch config decides, else "no")."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    def warmup_for(self, total_steps: int) -> int:
        """Warmup optimizer steps for a run of ``total_steps`` (a ratio rounds up, as in transformers)."""
        if 0 < self.warmup_steps < 1:
            return math.ceil(total_steps * self.warmup_steps)
        if self.warmup_ratio:
            return math.ceil(total_steps * self.warmup_ratio)
        return int(self.warmup_steps)

    def interval(self, name: str, total_steps: int) -> int:
        """``logging_steps`` / ``eval_steps`` / ``save_steps`` in optimizer steps (a ratio of ``total_steps``)."""
        value = getattr(self, name)
        if name == "eval_steps" and value is None:
            value = self.logging_steps
        if 0 < value < 1:
            return max(1, math.ceil(total_steps * value))
        return int(value)

    def to_dict(self) -> dict[str, Any]:
        """The arguments as plain data (for trackers' run config); dict-valued knobs are kept as given."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = os.fspath(value) if isinstance(value, os.PathLike) else value
        return out


# --- helpers ----------------------------------------------------------------------------------------------------
def _integer(name: str, value: Any, minimum: int, fix: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}" + (f" {fix}" if fix else ""))


def _number(name: str, value: Any, low: float, high: float | None = None, open_low: bool = False,
            fix: str = "") -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (high is None or value <= high)
    if not ok:
        bound = f"> {low:g}" if open_low else f">= {low:g}"
        if high is not None:
            bound += f" and <= {high:g}"
        raise ConfigError(f"{name}={value!r} must be a number {bound}" + (f" {fix}" if fix else ""))


def _multiple(save_steps: float, eval_steps: float) -> bool:
    """transformers' test: whole steps divide, ratios divide in millionths; a ratio and a step count never do."""
    if save_steps >= 1 and eval_steps >= 1:
        return int(save_steps) % int(eval_steps) == 0
    if save_steps < 1 and eval_steps < 1:
        return round(save_steps * 1_000_000) % round(eval_steps * 1_000_000) == 0
    return False


def _steps(name: str, value: Any) -> None:
    _number(name, value, low=0.0, open_low=True,
            fix="(an integer number of optimizer steps, or a float in (0, 1) for a share of the total)")
    if value >= 1 and value != int(value):
        raise ConfigError(f"{name}={value!r} must be a whole number of steps, or a float in (0, 1)")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    hint = did_you_mean(str(value), choices)
    raise ConfigError(f"{name}={value!r} is not allowed; use one of {', '.join(repr(c) for c in choices)}{hint}")


def resolve_report_to(report_to: Any) -> list[str]:
    """The trackers asked for: None/"none" -> [], "all" -> every installed one, else the named ones.

    Example::

        resolve_report_to("tensorboard")   # ['tensorboard']
    """
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if any(not isinstance(n, str) for n in names):
        raise ConfigError(f"report_to={report_to!r} must be a tracker name or a list of them")
    names = [n.lower() for n in names]
    if names in (["none"], []):
        return []
    if names == ["all"]:
        from impel.trackers.registry import installed_trackers

        return installed_trackers()
    for n in names:
        if n not in TRACKERS:
            raise ConfigError(f"report_to={n!r} is not a tracker impel knows; use 'none', 'all' or any of "
                              f"{', '.join(repr(t) for t in TRACKERS)}{did_you_mean(n, TRACKERS + ('none', 'all'))}")
    return list(dict.fromkeys(names))
