"""Configuration objects users build in code, with Accelerate's names and fields.

They are thin: each validates its own fields and the Accelerator reads them; none holds behaviour.
"""
from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from impel.config.deepspeed_plugin_members import DeepSpeedPluginMembers
from impel.config.fsdp_values import class_names, enum_name, mixed_precision_mode, offload_flag
from impel.config.kwargs_handler import KwargsHandler
from impel.config.plugin_refusals import DEEPSPEED_REFUSED, FSDP_REFUSED, refuse_set
from impel.config.profiling import ProfileKwargs
from impel.config.run_config import (
    ConfigError,
    DeepSpeedConfig,
    FSDPConfig,
    plugin_keyword,
    plugin_keywords,
)


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}({name}={value!r}) must be True or False")


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.nn.parallel.DistributedDataParallel``.

    ``comm_hook`` / ``comm_wrapper`` / ``comm_state_option`` are Accelerate's DDP communication hook (gradient
    compression, PowerSGD), registered on each DDP model impel wraps; they are not DDP arguments, so ``to_kwargs``
    leaves them out (see :mod:`impel.config.ddp_hooks`).

    Example::

        DistributedDataParallelKwargs(comm_hook="fp16")  # all-reduce gradients in float16
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = "no"
    comm_wrapper: Any = "no"
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from impel.config.ddp_hooks import check_comm_hook

        check_comm_hook(self.comm_hook, self.comm_wrapper, self.comm_state_option)

    def to_kwargs(self) -> dict[str, Any]:
        from impel.config.ddp_hooks import HOOK_FIELDS

        return {k: v for k, v in super().to_kwargs().items() if k not in HOOK_FIELDS}


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.amp.GradScaler`` (fp16 only)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.init_scale <= 0 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ConfigError(f"{self!r} is invalid: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1")


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Process-group settings: backend (None = nccl on CUDA, gloo on CPU) and the collective timeout."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in ("nccl", "gloo", "mpi", "cpu:gloo,cuda:nccl"):
            raise ConfigError(f"InitProcessGroupKwargs(backend={self.backend!r}) is unknown; use 'nccl', 'gloo' or "
                              "None")
        if self.timeout is not None and (not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0):
            raise ConfigError(f"InitProcessGroupKwargs(timeout={self.timeout!r}) must be a positive datetime.timedelta")


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast`` inside the prepared model's forward."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard and place batches (Accelerate's fields, defaults and sample order).

    split_batches: the loader's batch_size is the global batch, split across ranks (must divide evenly);
    otherwise it is the per-rank batch. even_batches: the last global batch is completed with samples from the
    start so every rank runs the same number of steps (``gather_for_metrics`` drops the duplicates).
    use_seedable_sampler: a shuffled loader's epoch ``e`` order comes from ``data_seed + e`` (``data_seed`` defaults
    to rank 0's ``torch.initial_seed()``); otherwise from the sampler's generator, agreed across ranks, and a
    ``data_seed`` changes nothing (a warning says so; Accelerate ignores it there too).
    non_blocking: host-to-device copies are asynchronous (pin_memory recommended).
    dispatch_batches: True: rank 0 reads and every rank receives its slice of each global batch, as Accelerate's
    dispatcher (``impel.runtime.loaders.dispatch``); False: every rank reads its own shard; None (Accelerate's default):
    True for an iterable dataset on several data-parallel ranks with device placement, else False.
    use_stateful_dataloader: prepared loaders always save and restore their position (``state_dict`` /
    ``load_state_dict``, ``save_state``), which is what this flag asks of Accelerate; True and False both hold.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking",
                     "use_stateful_dataloader"):
            _check_bool("DataLoaderConfiguration", name, getattr(self, name))
        if self.dispatch_batches is not None:
            _check_bool("DataLoaderConfiguration", "dispatch_batches", self.dispatch_batches)
        if self.data_seed is not None and (isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)):
            raise ConfigError(f"DataLoaderConfiguration(data_seed={self.data_seed!r}) must be an integer or None")
        if self.data_seed is not None and not self.use_seedable_sampler:  # accepted, as Accelerate does
            warnings.warn(f"DataLoaderConfiguration(data_seed={self.data_seed}) only seeds the seedable sampler, so "
                          "without use_seedable_sampler=True it changes nothing (as in Accelerate, which ignores it "
                          "there): add use_seedable_sampler=True for the order to follow it", stacklevel=3)


@dataclass
class GradientAccumulationPlugin:
    """Gradient accumulation settings.

    num_steps: micro-steps per optimizer step (None: the launched config's, as when no plugin is given).
    adjust_scheduler: kept for Accelerate's signature; as in Accelerate 1.15 the prepared scheduler never steps mid-
    group either way (False warns; ``Accelerator(step_scheduler_with_optimizer=False)`` steps it on every call).
    sync_with_dataloader: the end of a prepared dataloader ends the group. sync_each_batch: all-reduce gradients on
    every micro-step (less memory, more communication). short_group_divisor (impel's): what ``accelerator.backward``
    divides the loss by in a group cut short by the end of the dataloader: ``"nominal"`` (default, Accelerate's
    numbers) divides by ``num_steps`` as in every group; ``"actual"`` divides by the group's real length, so its
    gradient is a mean like every other group's.
    """

    num_steps: int | None = 1  # None: the launched config's gradient_accumulation_steps
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    short_group_divisor: str = "nominal"

    def __post_init__(self) -> None:
        if self.num_steps is not None and (isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int)
                                           or self.num_steps < 1):
            raise ConfigError(f"GradientAccumulationPlugin(num_steps={self.num_steps!r}) must be an integer >= 1")
        for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
            _check_bool("GradientAccumulationPlugin", name, getattr(self, name))
        if self.short_group_divisor not in ("nominal", "actual"):
            raise ConfigError(f"GradientAccumulationPlugin(short_group_divisor={self.short_group_divisor!r}) must be "
                              "'nominal' (divide by num_steps, as Accelerate) or 'actual' (by the group's length)")
        if not self.adjust_scheduler:
            warnings.warn("GradientAccumulationPlugin(adjust_scheduler=False) changes nothing (as in Accelerate 1.15): "
                          "the prepared scheduler still steps only after real optimizer steps; pass "
                          "Accelerator(step_scheduler_with_optimizer=False) to step it on every call", stacklevel=3)


@dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and logs, and how ``save_state`` names and rotates checkpoints.

    project_dir: the run's directory. logging_dir: for trackers (defaults to project_dir).
    automatic_checkpoint_naming: ``save_state()`` writes ``project_dir/checkpoints/checkpoint_<iteration>`` and
    ``load_state()`` reads the newest complete one. total_limit: keep at most this many complete checkpoints
    (the oldest are deleted after each save). iteration: the number the next automatic save gets (restored by
    ``load_state``). save_on_each_node: every node's local main process writes (for node-local disks).
    automatic_resume: load the newest complete checkpoint when training starts and save one on SIGTERM (see
    :mod:`impel.accelerator.resilience`; the same as ``impel launch --auto_resume``). async_save: ``save_state()``
    returns once
    the state is staged in CPU memory and writes the checkpoint in the background (the default of its
    ``async_save`` argument; the same as the ``async_save`` config key; see docs/checkpoints.md).

    Example::

        acc = Accelerator(project_config=ProjectConfiguration("runs/a", automatic_checkpoint_naming=True,
                                                              total_limit=3))
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    automatic_resume: bool = False
    async_save: bool = False

    def __post_init__(self) -> None:
        for name in ("automatic_checkpoint_naming", "save_on_each_node", "automatic_resume", "async_save"):
            _check_bool("ProjectConfiguration", name, getattr(self, name))
        limit = self.total_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"ProjectConfiguration(total_limit={limit!r}) must be None (keep all) or an integer >= 1")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            raise ConfigError(f"ProjectConfiguration(iteration={self.iteration!r}) must be an integer >= 0")
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: Any = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` when it is unset); accepts any path-like."""
        self.project_dir = None if project_dir is None else os.fspath(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        else:
            self.logging_dir = os.fspath(self.logging_dir)


KWARGS_HANDLER_TYPES = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs)


@dataclass
class Handlers:
    """The kwargs handlers a user passed, one per type at most."""

    ddp: DistributedDataParallelKwargs | None = None
    scaler: GradScalerKwargs | None = None
    init: InitProcessGroupKwargs | None = None
    autocast: AutocastKwargs | None = None
    profile: ProfileKwargs | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def collect(cls, handlers: Any) -> Handlers:
        out = cls()
        slots = {DistributedDataParallelKwargs: "ddp", GradScalerKwargs: "scaler",
                 InitProcessGroupKwargs: "init", AutocastKwargs: "autocast", ProfileKwargs: "profile"}
        for handler in handlers or ():
            slot = slots.get(type(handler))
            if slot is None:
                names = ", ".join(t.__name__ for t in slots)
                raise ConfigError(f"kwargs_handlers got {handler!r}; allowed types are {names}")
            if getattr(out, slot) is not None:
                raise ConfigError(f"kwargs_handlers holds two {type(handler).__name__}; pass one")
            setattr(out, slot, handler)
        return out


def by_hand(default: object = None, *, before: str | None = None) -> Any:
    """A plugin field written by hand (not a config field), placed before the generated keyword ``before``
    (after all of them without one)."""
    return field(default=default, metadata={"before": before})


def _annotation(meta: Any, enums: bool) -> str:
    if meta["listed"] or enums and meta["choices"] is not None and meta["kind"] == "str":
        return "Any"  # a list of names or classes; torch's enums (ShardingStrategy.FULL_SHARD) or their names
    return f"{meta['kind']} | None"


def config_backed(section: type, *, enums: bool = False) -> Callable[[type], type]:
    """Make a plugin class a dataclass whose keywords are generated from ``section``'s fields (named by
    :func:`impel.config.run_config.plugin_keyword`, default None: "not set here") around the fields the class writes by
    hand.
    ``enums``: fields with choices also take torch's enums.

    Each generated field's metadata names its config field (``{"config": "version"}`` for ``fsdp_version``).
    """
    def build(cls: type) -> type:
        own = inspect.get_annotations(cls)
        generated: dict[str, tuple[str, object]] = {}
        for f in fields(section):
            keyword = plugin_keyword(f)
            if keyword is None:
                continue
            if keyword in own:
                raise TypeError(f"{cls.__name__}.{keyword} is generated from {section.__name__}.{f.name}; remove "
                                "it from the class body")
            generated[keyword] = (_annotation(f.metadata, enums), field(default=None, metadata={"config": f.name}))
            for name in f.metadata["also"]:
                if name not in own:
                    raise TypeError(f"{section.__name__}.{f.name} says {cls.__name__} also takes {name!r}, which the "
                                    "class does not define")
        order = list(generated)
        for name in own:
            spec = cls.__dict__.get(name, MISSING)
            before = spec.metadata.get("before") if isinstance(spec, Field) else None
            if before is not None and before not in generated:
                raise TypeError(f"{cls.__name__}.{name} is placed before {before!r}, which is not a generated field")
            order.insert(order.index(before) if before is not None else len(order), name)
        annotations = {name: own[name] if name in own else generated[name][0] for name in order}
        for name, (_, spec) in generated.items():
            setattr(cls, name, spec)
        cls.__annotations__ = annotations
        return dataclass(cls)
    return build


@config_backed(FSDPConfig, enums=True)
class FullyShardedDataParallelPlugin:
    """FSDP settings in code, with Accelerate's field names; a field left at None is not set here (the launched
    config or the default decides). The keywords of the ``fsdp_config`` options are generated from
    :class:`impel.config.run_config.FSDPConfig`, so each has the same choices, help and validation as its YAML key.
    Enum values
    of torch's FSDP1 API (``ShardingStrategy.FULL_SHARD``, ``BackwardPrefetch.BACKWARD_PRE``, ``StateDictType...``)
    and their names as strings are both accepted.

    ``cpu_offload`` (Accelerate) and ``offload_params`` (the YAML key) are the same switch: a bool, FSDP1's
    ``CPUOffload(offload_params=...)`` or FSDP2's ``CPUOffloadPolicy()``. ``mixed_precision_policy`` is
    ``"bf16"``/``"fp16"``/``"no"``, a dict or a ``MixedPrecision``/``MixedPrecisionPolicy`` whose param dtype picks
    the mode; impel always reduces gradients in float32 (see ``accelerator.precision_report()``).

    Example::

        plugin = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP",
                                                transformer_cls_names_to_wrap=["GPT2Block"])
        acc = Accelerator(fsdp_plugin=plugin)
    """

    # one keyword per FSDPConfig field is generated (config_backed); written by hand:
    cpu_offload: Any = by_hand(before="offload_params")
    mixed_precision_policy: Any = None
    # Accelerate's arguments impel refuses when set (impel.config.plugin_refusals says why and what to use instead)
    ignored_modules: object = None
    state_dict_config: object = None
    optim_state_dict_config: object = None
    limit_all_gathers: bool = True
    param_init_fn: object = None
    activation_checkpointing_offload: object = None

    if TYPE_CHECKING:  # the dataclass __init__ config_backed builds, with keywords type checkers cannot see
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def __post_init__(self) -> None:
        refuse_set(self, FSDP_REFUSED)
        self.mixed_precision = mixed_precision_mode(self.mixed_precision_policy)
        self.to_config_section()  # validate now, with the YAML key names in the messages

    def to_config_section(self) -> dict[str, object]:
        """The explicitly given fields as an ``fsdp_config`` section (``fsdp_*`` keys), validated and normalised."""
        raw = self._raw_section()
        checked = FSDPConfig(**raw).validate()
        return {FSDPConfig.PREFIX + name: getattr(checked, name) for name in raw}

    def _raw_section(self) -> dict[str, Any]:
        """Config field -> the value given here (torch's enums and classes as names)."""
        out: dict[str, object] = {}
        for attr, name in _FSDP_KEYS.items():
            value = getattr(self, attr)
            if attr == "offload_params":  # cpu_offload is the same switch
                value = offload_flag(self.cpu_offload, value)
            if value is None:
                continue
            if attr == "auto_wrap_policy" and callable(value):
                raise ConfigError(f"FullyShardedDataParallelPlugin(auto_wrap_policy={value!r}): impel takes a policy "
                                  "name; use 'TRANSFORMER_BASED_WRAP' with transformer_cls_names_to_wrap=[...], "
                                  "'SIZE_BASED_WRAP' with min_num_params=N, or 'NO_WRAP'")
            if _LISTED[name]:
                value = class_names(value)
            out[name] = enum_name(value)
        return out

    def code_arguments(self, mixed_precision: str | None) -> dict[str, Any]:
        """What this plugin adds to the Accelerator's code arguments (merged over the launched config)."""
        mode = self.mixed_precision
        if mode is not None and mixed_precision is not None and mode != mixed_precision:
            raise ConfigError(f"Accelerator(mixed_precision={mixed_precision!r}) contradicts "
                              f"FullyShardedDataParallelPlugin(mixed_precision_policy={self.mixed_precision_policy!r})"
                              f" (= {mode!r}); set only one of them")
        return {"distributed_type": "FSDP", "fsdp_config": self.to_config_section(),
                "mixed_precision": mixed_precision or mode}


@config_backed(DeepSpeedConfig)
class DeepSpeedPlugin(DeepSpeedPluginMembers):
    """DeepSpeed ZeRO settings in code, with Accelerate's field names; a field left at None is not set here (the
    launched config, the DeepSpeed JSON or the default decides, and a contradiction with the JSON raises).

    ``hf_ds_config`` is the DeepSpeed JSON for every other setting: a path, or a dict (kept in the process, never
    written to the environment). ``is_train_batch_min``: with several prepared dataloaders, the smallest batch
    size is DeepSpeed's ``train_micro_batch_size_per_gpu`` (False: the largest). Accelerate's members
    (``deepspeed_config``, ``selected``, ``get_value``, ...) are :mod:`impel.config.deepspeed_plugin_members`'.

    Example::

        plugin = DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu", zero3_save_16bit_model=True)
        acc = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    """

    # one keyword per DeepSpeedConfig field that has one is generated (config_backed); written by hand, placed in
    # Accelerate's order:
    hf_ds_config: Any = by_hand(before="gradient_clipping")  # deepspeed_config_file, or a dict
    gradient_accumulation_steps: int | None = by_hand(before="gradient_clipping")  # the top-level key
    is_train_batch_min: bool = by_hand(True, before="offload_optimizer_device")
    transformer_moe_cls_names: object = None  # these three: refused when set (impel.config.plugin_refusals)
    enable_msamp: object = None
    msamp_opt_level: object = None

    if TYPE_CHECKING:  # the dataclass __init__ config_backed builds, with keywords type checkers cannot see
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def __post_init__(self) -> None:
        refuse_set(self, DEEPSPEED_REFUSED)
        source = self.hf_ds_config
        if source is not None and not isinstance(source, (str, os.PathLike, dict)):
            raise ConfigError(f"DeepSpeedPlugin(hf_ds_config={source!r}) must be a path to a DeepSpeed JSON or a dict")
        steps = self.gradient_accumulation_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"DeepSpeedPlugin(gradient_accumulation_steps={steps!r}) must be an integer >= 1")
        _check_bool("DeepSpeedPlugin", "is_train_batch_min", self.is_train_batch_min)
        self.to_config_section()  # validate now, with the YAML key names in the messages

    def to_config_section(self) -> dict[str, object]:
        """The explicitly given fields as a ``deepspeed_config`` section, validated (a dict JSON is not in it)."""
        raw = {name: getattr(self, attr) for attr, name in _DEEPSPEED_KEYS.items() if getattr(self, attr) is not None}
        if isinstance(self.hf_ds_config, (str, os.PathLike)):
            raw["deepspeed_config_file"] = os.path.abspath(os.fspath(self.hf_ds_config))
        checked = DeepSpeedConfig(**raw).validate()
        return {key: getattr(checked, key) for key in raw}

    def code_arguments(self, gradient_accumulation_steps: int | None) -> dict[str, object]:
        """What this plugin adds to the Accelerator's code arguments (merged over the launched config)."""
        steps = self.gradient_accumulation_steps
        if steps is not None and gradient_accumulation_steps is not None and steps != gradient_accumulation_steps:
            raise ConfigError(f"Accelerator(gradient_accumulation_steps={gradient_accumulation_steps}) contradicts "
                              f"DeepSpeedPlugin(gradient_accumulation_steps={steps}); set only one of them")
        return {"distributed_type": "DEEPSPEED", "deepspeed_config": self.to_config_section(),
                "gradient_accumulation_steps": steps if steps is not None else gradient_accumulation_steps}


# plugin keyword -> config field, computed from the sections (FSDPConfig.version is FullyShardedDataParallelPlugin's
# fsdp_version); FSDPConfig's listed fields take lists of names or classes
_FSDP_KEYS = plugin_keywords(FSDPConfig)
_DEEPSPEED_KEYS = plugin_keywords(DeepSpeedConfig)
_LISTED = {f.name: f.metadata["listed"] for f in fields(FSDPConfig)}


def resolve_project_configuration(project_dir: Any,
                                  project_config: ProjectConfiguration | None) -> ProjectConfiguration:
    """``Accelerator(project_dir=..., project_config=...)``: one config, the directory given once."""
    config = project_config if project_config is not None else ProjectConfiguration()
    if not isinstance(config, ProjectConfiguration):
        raise ConfigError(f"project_config={config!r} must be an impel.ProjectConfiguration")
    if project_dir is not None:
        wanted = os.fspath(project_dir)
        if config.project_dir is not None and config.project_dir != wanted:
            raise ConfigError(f"Accelerator(project_dir={wanted!r}) contradicts project_config.project_dir="
                              f"{config.project_dir!r}; pass the directory once")
        config.set_directories(wanted)
    return config
