"""DDP communication hooks: ``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)``.

Accelerate's names and semantics, carried out by torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``):
``comm_hook`` picks fp16 / bf16 compression of the gradient all-reduce or PowerSGD's low-rank approximation
(``power_sgd``, ``batched_power_sgd``); ``comm_wrapper`` casts what a PowerSGD hook communicates to fp16 / bf16;
``comm_state_option`` holds ``PowerSGDState``'s arguments (``matrix_approximation_rank``, ``start_powerSGD_iter``,
...). The DDP strategy registers the hook on each model it wraps, as Accelerate does right after wrapping.

Accelerate registers a hook only when given its enum members and silently ignores plain strings; impel takes
both. Where Accelerate would accept a setting and do nothing with it, impel refuses it: a wrapper or a PowerSGD
state without a PowerSGD hook, a hook under FSDP or DeepSpeed (which do not reduce gradients through DDP); and
``batched_power_sgd`` where torch's hook would fail at its first compressed iteration.

Example::

    handler = DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="fp16",
                                            comm_state_option={"matrix_approximation_rank": 2})
    accelerator = Accelerator(kwargs_handlers=[handler])
"""
from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from impel.config.run_config import ConfigError, did_you_mean

if TYPE_CHECKING:
    import torch
    from torch.nn.parallel import DistributedDataParallel

# The handler's fields that configure the hook; they are not DistributedDataParallel's own arguments.
HOOK_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")


class HookSettings(Protocol):
    """What this module reads of a ``DistributedDataParallelKwargs`` (:mod:`impel.config.plugins`, which validates its
    fields here: this module does not import it)."""

    comm_hook: Any
    comm_wrapper: Any
    comm_state_option: dict[str, Any]


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's DDP gradient-communication hooks (``no`` is plain all-reduce)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


_POWER_SGD = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
_WRAPPERS = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16)


def _hook_type(name: str, value: object) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in DDPCommunicationHookType)
        raise ConfigError(f"DistributedDataParallelKwargs({name}={value!r}) is not a DDP communication hook; "
                          f"use one of {allowed}") from None


def check_comm_hook(comm_hook: object, comm_wrapper: object,
                    comm_state_option: object) -> tuple[DDPCommunicationHookType, DDPCommunicationHookType]:
    """Validate the three hook fields together; return (hook, wrapper) as enum members."""
    hook, wrapper = _hook_type("comm_hook", comm_hook), _hook_type("comm_wrapper", comm_wrapper)
    if wrapper not in _WRAPPERS:
        raise ConfigError(f"DistributedDataParallelKwargs(comm_wrapper={wrapper.value!r}) is not a compression "
                          "wrapper; use 'no', 'fp16' or 'bf16' (PowerSGD is chosen with comm_hook)")
    if wrapper is not DDPCommunicationHookType.NO and hook not in _POWER_SGD:
        raise ConfigError(f"DistributedDataParallelKwargs(comm_wrapper={wrapper.value!r}) wraps a PowerSGD hook, but "
                          f"comm_hook={hook.value!r}: the wrapper would do nothing (or compress the fp16/bf16 hook's "
                          "gradients a second time); set comm_hook='power_sgd' or 'batched_power_sgd', or drop "
                          "comm_wrapper (comm_hook='fp16' / 'bf16' alone compresses the all-reduce)")
    if hook is DDPCommunicationHookType.BATCHED_POWER_SGD and not batched_power_sgd_works():
        import torch

        raise ConfigError("DistributedDataParallelKwargs(comm_hook='batched_power_sgd') cannot compress in this torch "
                          f"({torch.__version__}): its batched_powerSGD_hook hands a 2-D matrix to the batched "
                          "_orthogonalize and fails (AssertionError) at iteration start_powerSGD_iter, after training "
                          "uncompressed until then; use comm_hook='power_sgd' (per-tensor PowerSGD, same "
                          "comm_state_option and comm_wrapper)")
    if comm_state_option is not None and not isinstance(comm_state_option, Mapping):
        raise ConfigError(f"DistributedDataParallelKwargs(comm_state_option={comm_state_option!r}) must be a dict of "
                          "PowerSGDState arguments, e.g. {'matrix_approximation_rank': 2}")
    if comm_state_option:
        if hook not in _POWER_SGD:
            raise ConfigError(f"DistributedDataParallelKwargs(comm_state_option={dict(comm_state_option)!r}) "
                              f"configures PowerSGD, but comm_hook={hook.value!r} has no state; set "
                              "comm_hook='power_sgd' or 'batched_power_sgd', or drop comm_state_option")
        _check_power_sgd_options(comm_state_option)
    return hook, wrapper


def batched_power_sgd_works() -> bool:
    """Whether torch's batched_powerSGD_hook survives its first compressed iteration.

    It orthogonalises its 2-D low-rank factor with ``_orthogonalize``, which now takes only batches of matrices
    (3-D) and raises on the 2-D one (seen in torch 2.13). The probe makes exactly that call on a tiny factor; a torch
    without the private function is given the benefit of the doubt.
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    orthogonalize = getattr(powerSGD_hook, "_orthogonalize", None)
    if orthogonalize is None:
        return True
    try:
        orthogonalize(torch.ones(2, 1))
    except (AssertionError, IndexError, RuntimeError):
        return False
    return True


def _check_power_sgd_options(options: Mapping[str, Any]) -> None:
    """Refuse what ``PowerSGDState(process_group=None, **options)`` would refuse at prepare(), now."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    known = [p for p in inspect.signature(PowerSGDState.__init__).parameters if p not in ("self", "process_group")]
    for key in options:
        if key == "process_group":
            raise ConfigError("DistributedDataParallelKwargs(comm_state_option) sets 'process_group', which is "
                              "DDP's own group (the default one, as in Accelerate); drop the key")
        if key not in known:
            hint = did_you_mean(key, known) or f"; use one of {', '.join(known)}"
            raise ConfigError(f"DistributedDataParallelKwargs(comm_state_option) has {key!r}, which is not an "
                              f"argument of torch's PowerSGDState{hint}")
    try:
        PowerSGDState(None, **options)  # its own value checks (start_powerSGD_iter > 1 with error feedback, ...)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"DistributedDataParallelKwargs(comm_state_option={dict(options)!r}) is refused by "
                          f"torch's PowerSGDState: {exc}") from None


def refuse_hook_without_ddp(kwargs: HookSettings | None, distributed_type: str) -> None:
    """A comm hook changes DDP's all-reduce; FSDP and DeepSpeed reduce gradients their own way, so it cannot apply.

    One process (``NO``) has nothing to reduce: the handler is then merely unused, as all DDP arguments are.
    """
    if kwargs is None or distributed_type in ("NO", "MULTI_CPU", "MULTI_GPU"):
        return
    hook = DDPCommunicationHookType(kwargs.comm_hook)
    if hook is not DDPCommunicationHookType.NO:
        raise ConfigError(f"DistributedDataParallelKwargs(comm_hook={hook.value!r}) compresses DDP's gradient "
                          f"all-reduce, but distributed_type={str(distributed_type)!r} reduces gradients without DDP, "
                          "so the hook would not apply; drop comm_hook (and comm_wrapper / comm_state_option) or "
                          "train with DDP (MULTI_GPU / MULTI_CPU)")


def register_comm_hook(model: DistributedDataParallel, kwargs: HookSettings | None) -> None:
    """Register the handler's hook on a freshly wrapped DDP model (before its first backward), as Accelerate does."""
    if kwargs is None:
        return
    hook_type, wrapper_type = check_comm_hook(kwargs.comm_hook, kwargs.comm_wrapper, kwargs.comm_state_option)
    if hook_type is DDPCommunicationHookType.NO:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    state = None
    hook: Callable[..., object]  # (state, bucket) -> Future; the state is a PowerSGDState or None
    if hook_type in _POWER_SGD:
        hook = (powerSGD_hook.powerSGD_hook if hook_type is DDPCommunicationHookType.POWER_SGD
                else powerSGD_hook.batched_powerSGD_hook)
        state = powerSGD_hook.PowerSGDState(None, **(kwargs.comm_state_option or {}))
        if wrapper_type is DDPCommunicationHookType.FP16:
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif wrapper_type is DDPCommunicationHookType.BF16:
            hook = default_hooks.bf16_compress_wrapper(hook)
    elif hook_type is DDPCommunicationHookType.FP16:
        hook = default_hooks.fp16_compress_hook
    else:
        hook = default_hooks.bf16_compress_hook
    try:
        model.register_comm_hook(state, hook)
    except TypeError as exc:  # DDP refuses bf16 hooks unless torch is a CUDA build with NCCL >= 2.10 (or XPU)
        if DDPCommunicationHookType.BF16 not in (hook_type, wrapper_type):
            raise
        field = "comm_hook" if hook_type is DDPCommunicationHookType.BF16 else "comm_wrapper"
        raise ConfigError(f"DistributedDataParallelKwargs({field}='bf16') is refused by this torch's DDP ({exc}); "
                          f"use {field}='fp16', or a CUDA build of torch with NCCL 2.10+") from None


def reduction_dtype(kwargs: HookSettings | None) -> torch.dtype | None:
    """The dtype the hook all-reduces gradients in (None: the gradients' own dtype)."""
    import torch

    if kwargs is None:
        return None
    hook, wrapper = DDPCommunicationHookType(kwargs.comm_hook), DDPCommunicationHookType(kwargs.comm_wrapper)
    cast = wrapper if hook in _POWER_SGD else hook
    return {DDPCommunicationHookType.FP16: torch.float16, DDPCommunicationHookType.BF16: torch.bfloat16}.get(cast)
