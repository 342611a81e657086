"""The DeepSpeed JSON: load it, reconcile it with impel's settings, fill its ``"auto"`` values.

Two moments. At Accelerator creation (:func:`resolve_static`) the values impel already knows are settled: ZeRO
stage, offload, clipping, accumulation steps and bf16/fp16. At ``prepare`` (:func:`fill_runtime`) the rest is:
batch sizes from the prepared dataloader, optimizer and scheduler parameters from the placeholders
(:class:`DummyOptim`, :class:`DummyScheduler`). Each value may come from impel (code, YAML, launch flags) and from
the JSON: one-sided or equal is fine, ``"auto"`` takes impel's, and a contradiction raises naming both.

Nothing here imports deepspeed: the placeholders are public (``impel.DummyOptim``) and must stay cheap.
"""
from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from impel.config.deepspeed_values import check_json_values
from impel.config.run_config import DEFAULT_ZERO_STAGE, ConfigError, check_zero_stage
from impel.config.yaml_file import read_json_object

if TYPE_CHECKING:
    from impel.config.run_config import RunConfig

AUTO = "auto"
_ABSENT = object()
SAVE_16BIT_KEYS = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")


# --- placeholders ------------------------------------------------------------------------------------------------
class DummyOptim(torch.optim.Optimizer):
    """Stands for the optimizer the DeepSpeed JSON defines (its ``optimizer`` section); ``prepare`` replaces it.

    Its ``lr``, ``weight_decay`` and keyword arguments fill the ``"auto"`` values of ``optimizer.params``.

    Example::

        optim = DummyOptim(model.parameters(), lr=3e-4, weight_decay=0.01, betas=(0.9, 0.95))
        model, optim = accelerator.prepare(model, optim)   # optim now drives DeepSpeed's optimizer
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0.0, **kwargs: Any) -> None:
        # As given, groups with only their own keys: what DeepSpeed's optimizer is built over (torch's
        # Optimizer writes its defaults into the group dicts it gets, so it gets copies).
        self.params = [dict(g) if isinstance(g, Mapping) else g for g in params]
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs
        copies = [dict(g) if isinstance(g, Mapping) else g for g in self.params]
        super().__init__(copies, {"lr": lr, "weight_decay": weight_decay})

    def step(self, closure: object = None) -> NoReturn:
        raise RuntimeError("DummyOptim is a placeholder for the optimizer of a DeepSpeed JSON; pass it to "
                           "Accelerator.prepare() under DeepSpeed and step what prepare returns")


class DummyScheduler:
    """Stands for the scheduler the DeepSpeed JSON defines (its ``scheduler`` section); ``prepare`` replaces it.

    ``total_num_steps`` and ``warmup_num_steps`` (and keyword arguments) fill the ``"auto"`` values of
    ``scheduler.params``; ``lr_scheduler_callable(optimizer)`` builds a scheduler in code instead of the JSON's.

    Example::

        sched = DummyScheduler(optim, total_num_steps=1000, warmup_num_steps=100)
        model, optim, sched = accelerator.prepare(model, optim, sched)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int | None = None,
                 warmup_num_steps: int = 0, lr_scheduler_callable: Callable[[Any], Any] | None = None,
                 **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("DummyScheduler is a placeholder for the scheduler of a DeepSpeed JSON; pass it to "
                           "Accelerator.prepare() together with its optimizer under DeepSpeed")


# --- dotted access -----------------------------------------------------------------------------------------------
def get(ds: Mapping[str, Any], key: str) -> Any:
    node: Any = ds
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def put(ds: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = ds
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _same(a: object, b: object) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def settle(ds: dict[str, object], key: str, ours: object, ours_name: str, source: str, default: object = None) -> Any:
    """One value impel and the JSON may both give: equal or one-sided is fine, a contradiction raises.

    ``ours`` is impel's explicit value (None: not given). Absent or ``"auto"`` in the JSON takes ``ours``, else
    ``default``; with neither the key stays as it is (absent or "auto") for a later fill.
    """
    theirs = get(ds, key)
    if theirs is _ABSENT or theirs == AUTO:
        value = ours if ours is not None else default
        if value is not None:
            put(ds, key, value)
        return value
    if ours is not None and not _same(theirs, ours):
        raise ConfigError(f"{ours_name}={ours!r} contradicts {key}={theirs!r} in {source}; keep one of them "
                          f"(or write \"auto\" in the JSON to take impel's value)")
    return theirs


def find_auto(node: object, prefix: str = "") -> list[str]:
    """Dotted keys still holding "auto"."""
    if isinstance(node, Mapping):
        return [k for key, value in node.items() for k in find_auto(value, f"{prefix}{key}.")]
    return [prefix[:-1]] if node == AUTO else []


# --- loading -----------------------------------------------------------------------------------------------------
def load_json(source: Any) -> tuple[dict[str, object], str]:
    """(a deep copy of the JSON as a dict, a name for messages); ``source`` is a path, a dict or None."""
    if source is None:
        return {}, "the DeepSpeed config impel builds"
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source)), "DeepSpeedPlugin(hf_ds_config=<dict>)"
    path = os.fspath(source)
    return read_json_object(path, "deepspeed_config_file"), f"the DeepSpeed JSON {path!r}"


# --- at Accelerator creation -------------------------------------------------------------------------------------
@dataclass
class Resolved:
    """The JSON after :func:`resolve_static`, with what the strategy needs to know about it."""

    ds: dict[str, Any]
    source: str
    stage: int
    dtype: torch.dtype  # the engine's parameter dtype: float32, bfloat16 or float16
    clipping: float
    zero3_init: bool
    save_16bit: bool
    json_given: bool = True

    def offload(self, what: str) -> str:
        device = get(self.ds, f"zero_optimization.offload_{what}.device")
        return "none" if device in (_ABSENT, None) else str(device)


def settle_deepspeed(config: RunConfig, plugin: object) -> tuple[Resolved, dict[str, object]]:
    """The DeepSpeed JSON (the plugin's dict, else ``deepspeed_config_file``, else none) settled against the run
    config, and what it decides for the run config: ``gradient_accumulation_steps`` and ``mixed_precision``."""
    source = json_source(config, plugin)
    ds, name = load_json(source)
    return resolve_static(ds, name, config, json_given=source is not None)


def json_source(config: RunConfig, plugin: object) -> object:
    """Where the DeepSpeed JSON comes from: a dict given to ``DeepSpeedPlugin(hf_ds_config=...)``, else the config's
    ``deepspeed_config_file`` (a path given to the plugin is already there), else None."""
    path = config.deepspeed.deepspeed_config_file
    given = getattr(plugin, "hf_ds_config", None)
    if isinstance(given, Mapping):
        if path is not None:
            raise ConfigError(f"DeepSpeedPlugin(hf_ds_config=<dict>) and deepspeed_config_file={path!r} both "
                              "give the DeepSpeed JSON; keep one")
        return given
    return path


def resolve_static(ds: dict[str, object], source: str, config: RunConfig,
                   json_given: bool) -> tuple[Resolved, dict[str, object]]:
    """Settle what is known before prepare; returns the settled JSON and the accumulation steps and precision the
    run takes from it (``config`` is not changed)."""
    check_json_values(ds, source)
    section = config.deepspeed
    explicit = config.explicit
    key = "zero_optimization.stage"
    stage = settle(ds, key, section.zero_stage, "zero_stage", source,
                   default=DEFAULT_ZERO_STAGE if not json_given or get(ds, key) == AUTO else None)
    stage = 0 if stage is None else stage
    check_zero_stage(stage, f"zero_optimization.stage={stage!r} in {source}")
    for what in ("optimizer", "param"):
        _settle_offload(ds, what, section, source)
    clipping = settle(ds, "gradient_clipping", section.gradient_clipping, "gradient_clipping", source, default=0.0)
    save_16bit = _settle_save_16bit(ds, section.zero3_save_16bit_model, source)
    gas = settle(ds, "gradient_accumulation_steps",
                 config.gradient_accumulation_steps if "gradient_accumulation_steps" in explicit else None,
                 "gradient_accumulation_steps", source, default=config.gradient_accumulation_steps)
    mode, dtype = _settle_precision(ds, config, source)
    resolved = Resolved(ds, source, int(stage), dtype, float(clipping), bool(section.zero3_init_flag), save_16bit,
                        json_given)
    _check_combinations(resolved)
    ds.setdefault("steps_per_print", 2 ** 62)  # DeepSpeed's progress lines; impel's loop logs what it wants
    ds.setdefault("wall_clock_breakdown", False)
    return resolved, {"gradient_accumulation_steps": int(gas), "mixed_precision": mode}


def _settle_offload(ds: dict[str, Any], what: str, section: Any, source: str) -> None:
    ours = getattr(section, f"offload_{what}_device")
    key = f"zero_optimization.offload_{what}.device"
    if get(ds, key) is _ABSENT and ours in (None, "none"):
        return  # absent in the JSON means no offload, which an explicit "none" agrees with
    device = settle(ds, key, ours, f"offload_{what}_device", source, default="none")
    if device in ("none", None):
        ds["zero_optimization"].pop(f"offload_{what}", None)
        return
    path = settle(ds, f"zero_optimization.offload_{what}.nvme_path", getattr(section, f"offload_{what}_nvme_path"),
                  f"offload_{what}_nvme_path", source)
    if device != "nvme" and path == AUTO:
        del ds["zero_optimization"][f"offload_{what}"]["nvme_path"]
    elif device == "nvme" and path in (None, AUTO):
        raise ConfigError(f"offload_{what}_device='nvme' needs offload_{what}_nvme_path (a directory on the NVMe "
                          f"drive); set it in the config or as zero_optimization.offload_{what}.nvme_path in {source}")


def _settle_save_16bit(ds: dict[str, object], ours: bool | None, source: str) -> bool:
    present = [k for k in SAVE_16BIT_KEYS if get(ds, f"zero_optimization.{k}") is not _ABSENT]
    key = f"zero_optimization.{present[0] if present else SAVE_16BIT_KEYS[0]}"
    off = False if get(ds, key) == AUTO else None  # absent stays absent: DeepSpeed's default is off too
    return bool(settle(ds, key, ours, "zero3_save_16bit_model", source, default=off))


def _settle_precision(ds: dict[str, object], config: RunConfig, source: str) -> tuple[str, torch.dtype]:
    """bf16/fp16 ``enabled`` against mixed_precision: "auto" takes impel's, a JSON value may be adopted. Returns
    the run's mixed_precision mode and the engine's parameter dtype."""
    mode = config.mixed_precision if "mixed_precision" in config.explicit else None
    wanted = {}
    for name in ("bf16", "fp16"):
        theirs = get(ds, f"{name}.enabled")
        if theirs is _ABSENT and get(ds, name) is not _ABSENT:
            theirs = False  # a section without "enabled" is off in DeepSpeed
        wanted[name] = theirs
    concrete = [n for n, v in wanted.items() if v is True]
    if len(concrete) > 1:
        raise ConfigError(f"{source} enables both bf16 and fp16; enable at most one")
    if concrete and mode is not None and mode != concrete[0]:
        raise ConfigError(f"mixed_precision={mode!r} contradicts {concrete[0]}.enabled=true in {source}; keep one "
                          "(or write \"auto\" in the JSON)")
    # the JSON decides when impel was not told
    final = concrete[0] if concrete and mode is None else config.mixed_precision
    for name in ("bf16", "fp16"):
        if wanted[name] is False and final == name:
            raise ConfigError(f"mixed_precision={final!r} contradicts {name}.enabled=false in {source}; keep one "
                              "(or write \"auto\" in the JSON)")
        if wanted[name] is not False or final == name:
            put(ds, f"{name}.enabled", final == name)
    return final, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(final, torch.float32)


def _check_combinations(r: Resolved) -> None:
    if r.offload("param") != "none" and r.stage != 3:
        raise ConfigError(f"offload_param_device={r.offload('param')!r} needs ZeRO stage 3 (got stage {r.stage} "
                          f"from {r.source}); use offload_optimizer_device or zero_stage=3")
    if r.offload("optimizer") != "none" and r.stage == 0:
        raise ConfigError(f"offload_optimizer_device={r.offload('optimizer')!r} needs ZeRO stage 1, 2 or 3 (got "
                          f"stage 0 from {r.source}); set zero_stage")
    if r.zero3_init and r.stage != 3:
        raise ConfigError(f"zero3_init_flag=True needs ZeRO stage 3 (got stage {r.stage} from {r.source}); set "
                          "zero_stage=3 or drop zero3_init_flag")
    if r.save_16bit and r.stage != 3:
        raise ConfigError(f"zero3_save_16bit_model=True needs ZeRO stage 3 (got stage {r.stage} from {r.source}); "
                          "below stage 3 every rank holds the whole model and save_model needs no gathering")


def init_config(r: Resolved) -> dict[str, object]:
    """A copy DeepSpeed's ``zero.Init`` (and transformers) can parse before batch sizes are known."""
    ds = {k: copy.deepcopy(v) for k, v in r.ds.items() if k not in ("optimizer", "scheduler", "train_batch_size")}
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if ds.get(key) in (None, AUTO):
            ds[key] = 1  # only the batch bookkeeping reads these; partitioning does not
    return ds


# --- at prepare --------------------------------------------------------------------------------------------------
def fill_runtime(r: Resolved, *, micro_batch: int | None, world: int, optimizer: object, scheduler: object,
                 has_optimizer: bool, model: object = None) -> dict[str, object]:
    """The concrete JSON for one engine; raises for "auto" values nothing can fill."""
    ds = copy.deepcopy(r.ds)
    micro = settle(ds, "train_micro_batch_size_per_gpu", micro_batch, "the prepared DataLoader's batch size "
                   "per rank", r.source)
    gas = int(ds["gradient_accumulation_steps"])
    if micro is None:
        if has_optimizer:
            raise ConfigError("DeepSpeed needs train_micro_batch_size_per_gpu, and no prepared DataLoader tells it: "
                              "pass the training DataLoader to the same prepare() call as the model (or an earlier "
                              "one), or set train_micro_batch_size_per_gpu in the DeepSpeed JSON")
        micro = 1  # an engine without optimizer (evaluation) never reads its batch size
        ds["train_micro_batch_size_per_gpu"] = micro
    settle(ds, "train_batch_size", int(micro) * gas * world,
           f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size ({micro} * {gas} * {world})",
           r.source)
    _fill_optimizer(ds, optimizer, r.source)
    _fill_scheduler(ds, optimizer, scheduler, r.source)
    _fill_model_sizes(ds, model, r.source, by_default=r.stage == 3 and not r.json_given)
    if has_optimizer and not isinstance(optimizer, DummyOptim):
        ds.setdefault("zero_allow_untested_optimizer", True)  # any torch optimizer works under ZeRO
        if r.offload("optimizer") != "none":
            ds.setdefault("zero_force_ds_cpu_optimizer", False)  # the user's optimizer steps the offloaded states
    left = find_auto(ds)
    if left:
        raise ConfigError(f"{r.source} has \"auto\" values impel cannot fill: {', '.join(left)}; write concrete "
                          "values for them")
    return ds


# "auto" bucket sizes from the model's width, as transformers' and Accelerate's DeepSpeed integrations fill them
MODEL_SIZED = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
               "stage3_param_persistence_threshold": lambda h: 10 * h}


def hidden_size(model: object) -> int | None:
    """``config.hidden_size`` (or the largest of ``config.hidden_sizes``) of a transformers-style model."""
    config = getattr(getattr(model, "module", model), "config", None)
    size = getattr(config, "hidden_size", None)
    sizes = getattr(config, "hidden_sizes", None)
    if not isinstance(size, int) and isinstance(sizes, (list, tuple)) and sizes:
        size = max(sizes)
    return size if isinstance(size, int) and size > 0 else None


def _fill_model_sizes(ds: dict[str, object], model: object, source: str, by_default: bool) -> None:
    """Fill the "auto" sizes of MODEL_SIZED from the model's width. ``by_default`` (ZeRO-3 without a JSON): absent
    ones too, when the model has a width: DeepSpeed's own defaults (5e8-element buckets) hold ~2 GB of buffers,
    more than a 100M-parameter model's sharded states."""
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    wanted = [key for key in MODEL_SIZED if zero.get(key) == AUTO]
    width = hidden_size(model)
    if by_default and width is not None:
        wanted += [key for key in MODEL_SIZED if key not in zero]
    if not wanted:
        return
    if width is None:
        keys = ", ".join(f"zero_optimization.{key}" for key in wanted)
        raise ConfigError(f"{source} sets {keys} to \"auto\", which impel fills from the model's config.hidden_size, "
                          f"and {type(model).__name__} has none; write concrete values (DeepSpeed's defaults are "
                          "5e8 for the bucket sizes and 1e5 for the persistence threshold)")
    for key in wanted:
        zero[key] = MODEL_SIZED[key](width)


def _fill_optimizer(ds: dict[str, Any], optimizer: Any, source: str) -> None:
    defined = "optimizer" in ds
    if isinstance(optimizer, DummyOptim):
        if not defined:
            raise ConfigError(f"prepare() got a DummyOptim but {source} has no \"optimizer\" section; define the "
                              "optimizer there or pass a torch optimizer")
        given = {"lr": optimizer.lr, "weight_decay": optimizer.weight_decay, **optimizer.kwargs}
        _fill_params(ds["optimizer"].setdefault("params", {}), given, "optimizer", "DummyOptim")
    elif defined and optimizer is not None:
        raise ConfigError(f"prepare() got {type(optimizer).__name__} but {source} also defines an optimizer; pass "
                          "impel.DummyOptim(model.parameters(), ...) to use the JSON's, or remove its \"optimizer\"")


def _fill_scheduler(ds: dict[str, Any], optimizer: Any, scheduler: Any, source: str) -> None:
    defined = "scheduler" in ds
    if not isinstance(scheduler, DummyScheduler):
        if defined and scheduler is not None:
            raise ConfigError(f"prepare() got {type(scheduler).__name__} but {source} also defines a scheduler; pass "
                              "impel.DummyScheduler(optimizer, ...) to use the JSON's, or remove its \"scheduler\"")
        return
    if scheduler.lr_scheduler_callable is not None:
        if defined:
            raise ConfigError(f"DummyScheduler(lr_scheduler_callable=...) and the \"scheduler\" of {source} both "
                              "define the scheduler; keep one")
        return
    if not defined:
        raise ConfigError(f"prepare() got a DummyScheduler but {source} has no \"scheduler\" section; define it there "
                          "or give DummyScheduler(lr_scheduler_callable=...)")
    lr = optimizer.lr if isinstance(optimizer, DummyOptim) else _first_lr(optimizer)
    given = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": scheduler.warmup_num_steps,
             "total_num_steps": scheduler.total_num_steps, **scheduler.kwargs}
    _fill_params(ds["scheduler"].setdefault("params", {}), given, "scheduler", "DummyScheduler")


def _first_lr(optimizer: object) -> float | None:
    groups = getattr(optimizer, "param_groups", None)
    return groups[0].get("lr") if groups else None


def _fill_params(params: dict[str, object], given: Mapping[str, object], section: str, placeholder: str) -> None:
    for key, value in params.items():
        if value != AUTO:
            continue
        if given.get(key) is None:
            raise ConfigError(f"{section}.params.{key}=\"auto\" but {placeholder} gives no {key}; pass "
                              f"{placeholder}(..., {key}=...) or write the value in the JSON")
        filled = given[key]
        params[key] = list(filled) if isinstance(filled, tuple) else filled


def check_before_launch(config: RunConfig) -> None:
    """What ``impel launch`` can check before any rank starts: the JSON loads and nothing in it contradicts the
    launched settings (batch sizes and placeholders are only known at prepare)."""
    path = config.deepspeed.deepspeed_config_file
    ds, name = load_json(path)
    resolved, _ = resolve_static(ds, name, config, json_given=path is not None)
    world = config.num_processes if "num_processes" in config.explicit else None
    check_batch_sizes(resolved.ds, name, world)


def check_batch_sizes(ds: Mapping[str, object], source: str, world: int | None) -> None:
    """train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size (DeepSpeed's
    rule), as far as the concrete values tell before prepare; ``world`` None: not known yet."""
    total, micro, gas = (get(ds, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps"))
    concrete = [isinstance(v, int) and not isinstance(v, bool) for v in (total, micro, gas)]
    if not concrete[0] or not concrete[2]:
        return
    if concrete[1] and world is not None:
        if total != micro * gas * world:
            raise ConfigError(f"train_batch_size={total} in {source} is not train_micro_batch_size_per_gpu * "
                              f"gradient_accumulation_steps * world size ({micro} * {gas} * {world} = "
                              f"{micro * gas * world}); fix one of them, or write \"auto\" for train_batch_size")
        return
    step = gas * (micro if concrete[1] else 1) * (world or 1)
    if total % step:
        known = f"gradient_accumulation_steps={gas}" + (f" * train_micro_batch_size_per_gpu={micro}" if concrete[1]
                                                        else "") + (f" * world size {world}" if world else "")
        raise ConfigError(f"train_batch_size={total} in {source} is not a multiple of {known} (= {step}); fix one "
                          "of them, or write \"auto\" for train_batch_size")
