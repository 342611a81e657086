"""torch.compile through the Accelerator, as Accelerate offers it: ``Accelerator(dynamo_backend="inductor")``,
``Accelerator(dynamo_plugin=TorchDynamoPlugin(...))``, the ``dynamo_config`` section of a config file and
``impel launch --dynamo_backend ...`` (all one setting, :class:`impel.config.dynamo.DynamoConfig`).

Where the model is compiled (Accelerate's places):

- single device and DDP: the whole prepared model, after the DDP wrapper (``torch.compile(DDP(model))``, so torch's
  DDPOptimizer splits the graph at bucket boundaries); ``prepare`` returns the ``OptimizedModule``. impel's own
  forward bookkeeping (accumulation, the gradient-sync switch, the fp32 output cast) runs eagerly around the compiled
  call; autocast is inside it.
- ``use_regional_compilation``: each block of a repeated ``ModuleList`` (transformer layers) and each other subtree
  is compiled in place (``module.compile()``), so the compiler's cache is hit once per block class. In place means
  parameter names never change, on every strategy (Accelerate does this under FSDP2 and DeepSpeed).
- FSDP2: always per block before ``fully_shard``, as torchtitan does (after activation checkpointing); FSDP2's hooks
  are dynamo-disabled, so the all-gathers run eagerly between compiled blocks. A model without repeated blocks has its
  root forward compiled, with the FSDP hooks still outside.
- DeepSpeed: raises (not supported yet).

Checkpoints (``save_state``, ``get_state_dict``, ``save_model``) always use the original parameter names: impel keeps
the uncompiled model and reads state through it, never through ``_orig_mod``.
"""
from __future__ import annotations

import enum
import importlib.util
import logging
import shutil
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast

import torch
from torch import nn

from impel.config import environment as env
from impel.config.dynamo import BACKENDS, DynamoBackend, DynamoConfig
from impel.config.environment_settings import launched_settings
from impel.config.plugins import KwargsHandler
from impel.config.run_config import ConfigError
from impel.runtime.step.model_forward import ForwardContext, patch_forward, unpatch_forward

if TYPE_CHECKING:
    from impel.config.run_config import RunConfig

class Unwrapping(Protocol):
    """What compiling needs of a strategy (impel.strategies.base.Strategy has it; this module sits below them)."""

    def unwrap_model(self, model: nn.Module) -> nn.Module: ...


__all__ = ["DynamoBackend", "TorchDynamoPlugin", "has_compiled_regions", "is_compiled_module"]

logger = logging.getLogger("impel")

# TorchDynamoPlugin field -> dynamo_config key
_KEYS = {"backend": "dynamo_backend", "mode": "dynamo_mode", "fullgraph": "dynamo_use_fullgraph",
         "dynamic": "dynamo_use_dynamic", "use_regional_compilation": "dynamo_use_regional_compilation"}
_OTHERS = "; use 'inductor', 'aot_eager' or 'eager', or 'no' to train without compiling"
_GONE = ("AOT_TS_NVFUSER", "NVPRIMS_NVFUSER", "OFI")  # Accelerate still names them; torch removed them
_PACKAGES = {  # backend -> (module it needs, how to get it)
    "FX2TRT": ("torch_tensorrt", "pip install torch-tensorrt (NVIDIA GPUs)"),
    "TENSORRT": ("torch_tensorrt", "pip install torch-tensorrt (NVIDIA GPUs)"),
    "ONNXRT": ("onnxruntime", "pip install onnxruntime onnxscript"),
    "TVM": ("tvm", "pip install apache-tvm"),
    "AOT_TORCHXLA_TRACE_ONCE": ("torch_xla", "torch_xla on a TPU host, which impel does not drive"),
    "TORCHXLA_TRACE_ONCE": ("torch_xla", "torch_xla on a TPU host, which impel does not drive"),
    "HPU_BACKEND": ("habana_frameworks", "Habana's PyTorch bridge on a Gaudi host, which impel does not drive"),
    "NEURON": ("torch_neuronx", "torch-neuronx on a Trainium / Inferentia host, which impel does not drive"),
}


def backend_member(value: object) -> DynamoBackend:
    """``"inductor"``, ``"INDUCTOR"`` or ``DynamoBackend.INDUCTOR`` -> the member; anything else raises naming it."""
    name = value.value if isinstance(value, enum.Enum) else value
    if isinstance(name, str) and name.upper() in DynamoBackend:
        return DynamoBackend(name.upper())
    raise ConfigError(f"dynamo_backend={value!r} is not a torch.compile backend Accelerate names; use one of "
                      f"{', '.join(b.lower() for b in BACKENDS)}")


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How prepared models are compiled, with Accelerate's fields and defaults. A field left at None takes the
    launched config's value (``dynamo_config`` / ``--dynamo_*``), else the default: backend ``no`` (do not compile),
    mode ``default``, ``fullgraph=False``, ``dynamic=None`` (torch decides), ``use_regional_compilation=False``.
    ``options`` (the backend's options) and ``disable`` (compile nothing, for testing) stay in this process.

    Example::

        plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune", use_regional_compilation=True)
        acc = Accelerator(dynamo_plugin=plugin)
    """

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        if self.backend is not None:
            self.backend = backend_member(self.backend)
        if not isinstance(self.disable, bool):
            raise ConfigError(f"TorchDynamoPlugin(disable={self.disable!r}) must be True or False")
        if self.options is not None and not isinstance(self.options, dict):
            raise ConfigError(f"TorchDynamoPlugin(options={self.options!r}) must be a dict of backend options")
        given = self.to_config_section()  # the fields set here, validated (they win over the launched config)
        launched = (launched_settings() or {}).get("dynamo_config") or {}
        section = _section({**launched, **given})
        self.__dict__["_given"] = given
        self.backend = DynamoBackend(section.backend)
        self.mode, self.fullgraph, self.dynamic = section.mode, section.use_fullgraph, section.use_dynamic
        self.use_regional_compilation = section.use_regional_compilation
        if self.options and self.mode != "default":
            raise ConfigError(f"TorchDynamoPlugin(mode={self.mode!r}, options=...): torch.compile takes either a "
                              "mode or options; pass one of them")

    def to_config_section(self) -> dict[str, Any]:
        """The fields given in code, as ``dynamo_config`` keys (validated)."""
        if "_given" in self.__dict__:
            return dict(self.__dict__["_given"])
        raw = {key: getattr(self, attr) for attr, key in _KEYS.items() if getattr(self, attr) is not None}
        checked = _section(raw)
        return {key: getattr(checked, key[len(DynamoConfig.PREFIX):]) for key in raw}

    def code_arguments(self) -> dict[str, Any]:
        """What this plugin adds to the Accelerator's code arguments (merged over the launched config)."""
        given = self.to_config_section()
        return {"dynamo_config": given} if given else {}

    def to_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` keyword arguments (Accelerate's: settings left at torch's defaults are omitted)."""
        out: dict[str, Any] = {"backend": self.backend.value.lower()}
        if self.mode not in (None, "default"):
            out["mode"] = self.mode
        if self.fullgraph:
            out["fullgraph"] = True
        if self.dynamic is not None:
            out["dynamic"] = self.dynamic
        if self.options is not None:
            out["options"] = self.options
        if self.disable:
            out["disable"] = True
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend.value.lower(), "mode": self.mode, "fullgraph": self.fullgraph,
                "dynamic": self.dynamic, "options": self.options, "disable": self.disable,
                "use_regional_compilation": self.use_regional_compilation}


def _section(keys: dict[str, Any]) -> DynamoConfig:
    prefix = DynamoConfig.PREFIX
    if "dynamo_backend" in keys:
        keys = {**keys, "dynamo_backend": backend_member(keys["dynamo_backend"]).value}
    return DynamoConfig(**{k[len(prefix):]: v for k, v in keys.items()}).validate()


def dynamo_code_arguments(backend: object, plugin: TorchDynamoPlugin | None) -> dict[str, Any]:
    """The Accelerator's ``dynamo_backend`` / ``dynamo_plugin`` as code arguments (``{}`` when neither is given)."""
    if backend is not None and plugin is not None:
        raise ConfigError("pass either dynamo_backend or dynamo_plugin, not both (as in Accelerate)")
    if plugin is not None and not isinstance(plugin, TorchDynamoPlugin):
        raise ConfigError(f"dynamo_plugin={plugin!r} must be a TorchDynamoPlugin")
    if backend is not None:
        return {"dynamo_config": {"dynamo_backend": backend_member(backend).value}}
    return plugin.code_arguments() if plugin is not None else {}


def check_backend(backend: DynamoBackend, device: torch.device) -> None:
    """Raise, naming the backend and the fix, when it cannot run here (missing package, hardware or compiler)."""
    name = backend.value
    shown = f"dynamo_backend={name.lower()!r}"
    if name in _GONE:
        raise ConfigError(f"{shown} no longer exists in torch {torch.__version__}{_OTHERS}")
    if name == "CUDAGRAPHS" and device.type != "cuda":
        raise ConfigError(f"{shown} needs a CUDA device, but this process runs on {device.type}{_OTHERS}")
    if name == "INDUCTOR" and device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError(f"{shown} on CUDA needs triton, which is not installed: pip install triton{_OTHERS}")
    if name == "INDUCTOR" and device.type == "cpu" and not _cpp_compiler():
        raise ConfigError(f"{shown} on CPU compiles C++ but no compiler was found (g++, clang++ or $CXX): install "
                          f"one (apt-get install g++){_OTHERS}")
    if name in _PACKAGES:
        module, how = _PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{shown} needs the {module} package, which is not installed: {how}{_OTHERS}")
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    try:
        lookup_backend(name.lower())
    except Exception:  # noqa: BLE001 - torch's InvalidBackend or a failing lazy import: both mean "cannot run"
        known = ", ".join(list_backends(exclude_tags=()))
        raise ConfigError(f"{shown}: torch {torch.__version__} has no such backend registered (it has: {known})"
                          f"{_OTHERS}") from None


def _cpp_compiler() -> bool:
    return bool(env.cxx_compiler()) or any(shutil.which(c) for c in ("g++", "clang++", "c++"))


class _CompiledForward(ForwardContext):
    """impel's bookkeeping on the ``OptimizedModule``: eager, outside the compiled call; it switches gradient sync
    on the model under it (the DDP wrapper)."""

    def before_forward(self, model: nn.Module) -> None:
        super().before_forward(_orig_mod(model))


def settle_dynamo(config: RunConfig, given: TorchDynamoPlugin | None, device: torch.device,
                  engine_managed: bool) -> TorchDynamoPlugin:
    """The plugin from the merged config (code > launch > defaults), checked to run here and with this strategy."""
    section = config.dynamo_config or DynamoConfig()
    extras = {"options": given.options, "disable": given.disable} if given is not None else {}
    plugin = TorchDynamoPlugin(backend=section.backend, mode=section.mode, fullgraph=section.use_fullgraph,
                               dynamic=section.use_dynamic, use_regional_compilation=section.use_regional_compilation,
                               **extras)
    if plugin.backend != DynamoBackend.NO and not plugin.disable:
        if engine_managed:
            raise ConfigError(f"dynamo_backend={plugin.backend.value.lower()!r} under DeepSpeed is not supported "
                              "yet: impel does not compile a DeepSpeed engine; drop dynamo_backend (or "
                              "dynamo_config), or train with FSDP (--use_fsdp) or DDP")
        check_backend(plugin.backend, device)
    return plugin


class Compiler:
    """The resolved compile settings of one Accelerator and where they are applied (see the module docstring)."""

    def __init__(self, plugin: TorchDynamoPlugin, per_block: bool) -> None:
        self.plugin = plugin
        self.per_block = per_block  # the strategy compiles each block before sharding (FSDP2): nothing here

    def configure_backends(self, mixed_precision: str, device: torch.device) -> None:
        """As Accelerate: a compiled fp32 run on CUDA uses TF32 matmuls (called once, by the Accelerator)."""
        if self.active and mixed_precision == "no" and device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True

    @property
    def active(self) -> bool:
        return self.plugin.backend != DynamoBackend.NO and not self.plugin.disable

    # --- applying it ----------------------------------------------------------------------------------------
    def prepared(self, model: nn.Module, strategy: Unwrapping) -> nn.Module:
        """Compile a prepared (wrapped and forward-patched) model; returns what ``prepare`` hands back."""
        if not self.active or self.per_block:
            return model  # FSDP: compiled per block in the strategy, before sharding
        inner = strategy.unwrap_model(model)
        if any(is_compiled_module(m) for m in inner.modules()):
            logger.info("torch.compile: %s already holds compiled modules; prepare does not compile it again",
                        type(inner).__name__)
            return model
        if self.plugin.use_regional_compilation:
            targets = regions(inner)
            if targets != [inner]:
                for target in targets:
                    target.compile(**self.plugin.to_kwargs())
                return model
        return self._whole(model, inner)

    def _whole(self, model: nn.Module, inner: nn.Module) -> nn.Module:
        top: ForwardContext = model.__dict__["_impel_ctx"]
        if inner is model:  # autocast stays inside the compiled graph; the bookkeeping moves outside it
            patch_forward(model, ForwardContext(top.strategy, top.gradient_state, top.autocast, track=False))
        else:  # the DDP wrapper runs its own forward: dynamo runs it eagerly and compiles the module under it
            unpatch_forward(model)
        compiled = _compile(model, self.plugin.to_kwargs())
        patch_forward(compiled, _CompiledForward(top.strategy, top.gradient_state, None, track=True,
                                                 cast_outputs=top.cast_outputs))
        compiled.__dict__["_impel_compile_kwargs"] = self.plugin.to_kwargs()
        return compiled

    def before_shard(self, model: nn.Module) -> None:
        """FSDP2: compile each block in place before ``fully_shard`` (torchtitan's order: after activation
        checkpointing, before sharding); without repeated blocks, the root's forward."""
        if not self.active:
            return
        if not self.plugin.use_regional_compilation:
            logger.info("torch.compile under FSDP2 compiles per block before sharding (as torchtitan), not the "
                        "whole model")
        kwargs = self.plugin.to_kwargs()
        targets = regions(model)
        if targets == [model]:  # the forward function only: FSDP's root hooks (and impel's forward) stay eager
            model.__dict__["forward"] = torch.compile(model.forward, **kwargs)
            return
        for target in targets:
            target.compile(**kwargs)


# --- regions, unwrapping -----------------------------------------------------------------------------------------
def _compile(module: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
    """``torch.compile(module)``: an ``OptimizedModule`` (torch types the result as a plain callable)."""
    return cast(nn.Module, torch.compile(module, **kwargs))


def _orig_mod(compiled: nn.Module) -> nn.Module:
    """The module under an ``OptimizedModule`` (a submodule: torch types ``Module.__getattr__`` as Tensor | Module)."""
    return cast(nn.Module, compiled._orig_mod)


def _repeated(module: nn.Module) -> TypeGuard[nn.ModuleList]:
    return (isinstance(module, nn.ModuleList) and len(module) > 0
            and all(isinstance(m, type(module[0])) for m in module))


def regions(module: nn.Module) -> list[nn.Module]:
    """What regional compilation compiles (Accelerate's split): each block of a ``ModuleList`` of one class, and
    each other subtree that holds no such list; ``[module]`` when it holds none at all."""
    if _repeated(module):
        return list(module)
    if any(_repeated(m) for m in module.modules()):
        return [r for child in module.children() for r in regions(child)]
    return [module]


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (an ``OptimizedModule``)."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled (and importing dynamo costs seconds)
        return False
    return isinstance(module, sys.modules["torch._dynamo"].eval_frame.OptimizedModule)


def has_compiled_regions(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` is compiled (an ``OptimizedModule`` or compiled in place)."""
    return any(is_compiled_module(m) or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


def uncompiled(model: nn.Module) -> nn.Module:
    """The model under a ``torch.compile`` wrapper (the model itself when it is not one)."""
    return _orig_mod(model) if is_compiled_module(model) else model


def _strip_parallel(module: nn.Module) -> nn.Module:
    """``module`` without torch's ``DataParallel`` / ``DistributedDataParallel`` or a DeepSpeed engine around it
    (several layers too): what a user or a library wrapped by hand."""
    wrappers: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None:
        wrappers += (deepspeed.DeepSpeedEngine,)
    while isinstance(module, wrappers):
        module = cast(nn.Module, module.module)
    return module


def unwrap(strategy: Unwrapping, model: nn.Module, keep_fp32_wrapper: bool, keep_torch_compile: bool) -> nn.Module:
    """``accelerator.unwrap_model`` (Accelerate's semantics): the user's module without distributed wrappers (the
    strategy's, and a ``DataParallel`` / DDP the user added); with ``keep_torch_compile`` (the default) a compiled
    model stays compiled (an ``OptimizedModule`` around the unwrapped module), else the module under the compile
    wrapper. Regionally compiled blocks are compiled in place and stay so."""
    compiled = model if is_compiled_module(model) else None
    base = uncompiled(model)
    inner = _strip_parallel(strategy.unwrap_model(_strip_parallel(base)))
    if not keep_fp32_wrapper:
        unpatch_forward(inner)
        if compiled is not None:
            unpatch_forward(compiled)
    if compiled is None or not keep_torch_compile:
        return inner
    if inner is base:
        return compiled
    return _compile(inner, compiled.__dict__.get("_impel_compile_kwargs", {}))


class _NoStrategy:
    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> nn.Module:
    """Accelerate's ``extract_model_from_parallel``: ``model`` without ``DataParallel`` / DDP / DeepSpeed wrappers
    (inside ``torch.compile`` too), as ``accelerator.unwrap_model`` does; FSDP2 shards in place, so there is no
    wrapper to remove (``recursive`` is accepted for that reason and changes nothing)."""
    return unwrap(_NoStrategy(), model, keep_fp32_wrapper, keep_torch_compile)
