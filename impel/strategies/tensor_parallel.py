"""Tensor parallelism at ``prepare``: a model's plan applied with torch's ``parallelize_module`` and ParallelStyles
(no collectives of impel's own), and the gradient norm over DTensor shards.

The plan (module path -> style) comes from, in order: the user's ``TorchTensorParallelConfig(tp_plan=...)``; a
transformers model's own (``model.tp_plan``, else ``config.base_model_tp_plan`` under ``base_model_prefix``: the
config's keys are relative to the base model, ``layers.*.self_attn.q_proj`` is ``model.layers.*...`` in a
``*ForCausalLM``). A model whose parameters are already DTensors (``from_pretrained(tp_plan=...)``) is left as is.

Styles, named as in transformers' plans, map onto torch's:

| name | torch |
|---|---|
| colwise | ``ColwiseParallel()``: weight rows sharded, output's last dim sharded (local heads for q/k/v) |
| rowwise | ``RowwiseParallel()``: input's last dim sharded, output all-reduced |
| colwise_rep, colwise_gather_output | ``ColwiseParallel(output_layouts=Replicate())`` (e.g. lm_head) |
| rowwise_rep, rowwise_split_input | ``RowwiseParallel(input_layouts=Replicate())`` |
| embedding_rowwise | ``RowwiseParallel(input_layouts=Replicate())`` on an ``nn.Embedding`` (vocabulary sharded) |
| embedding_colwise | ``ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())`` (``nn.Embedding``) |
| sequence_parallel | ``SequenceParallel()`` |
| replicate | left alone (every rank keeps the full parameter) |

With colwise q/k/v projections, each rank's attention sees ``num_attention_heads / tp_size`` heads: transformers'
Llama-family attention reshapes with ``-1`` heads, so the local view is right; the head counts must divide by
``tp_size`` (checked).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from impel.config.run_config import ConfigError
from impel.strategies.fsdp_loading import ParamReplacements

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

logger = logging.getLogger("impel")


def torch_style(name: str) -> ParallelStyle | None:
    """A fresh torch ParallelStyle for a plan's style name (None for 'replicate')."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    table = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(),
        "replicate": lambda: None,
    }
    if name not in table:
        raise ConfigError(f"tensor-parallel style {name!r} has no torch ParallelStyle in impel; the model's plan needs "
                          f"it: load the model with transformers' from_pretrained(tp_plan='auto') (impel keeps an "
                          f"already parallel model as is), or pass a plan with {', '.join(table)}")
    return table[name]()


def is_dtensor(tensor: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def has_dtensor(model: nn.Module) -> bool:
    """True when some parameter is a DTensor (tensor parallel, FSDP2)."""
    return any(is_dtensor(p) for p in model.parameters())


def model_plan(model: nn.Module) -> dict[str, object] | None:
    """A transformers model's own plan with full module paths, or None."""
    for attr in ("tp_plan", "_tp_plan"):  # transformers 5 / 4.5x keep the merged, prefixed plan on the instance
        plan = getattr(model, attr, None)
        if isinstance(plan, Mapping) and plan:
            return dict(plan)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "") or ""
    inner = getattr(model, prefix, None) if prefix else None
    lead = f"{prefix}." if isinstance(inner, nn.Module) and inner is not model else ""
    return {lead + key: style for key, style in base.items()}


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(re.escape(key).replace(r"\*", r"[^.]+"))


def expand(model: nn.Module, plan: Mapping[str, object]) -> tuple[dict[str, Any], set[str]]:
    """The plan on concrete module names (``*`` is one path component), and the keys that matched a module."""
    names = [name for name, _ in model.named_modules() if name]
    concrete: dict[str, Any] = {}  # torch ParallelStyles (a plan's values: a style name or one)
    matched: set[str] = set()
    for key, style in plan.items():
        pattern = _pattern(key)
        for name in names:
            if pattern.fullmatch(name):
                matched.add(key)
                value = torch_style(style) if isinstance(style, str) else style
                if value is not None:
                    concrete[name] = value
    return concrete, matched


def _candidates(model: nn.Module) -> str:
    linear = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    return ", ".join(repr(n) for n in linear[:6]) + (", ..." if len(linear) > 6 else "") or "none"


def _check_divisible(model: nn.Module, concrete: Mapping[str, object], tp_size: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ConfigError(f"tp_size={tp_size} does not divide {type(model).__name__}'s {attr}={heads}: each "
                              "tensor-parallel rank must hold whole attention heads; pick a tp_size that divides it")
    for name, style in concrete.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
            rows = isinstance(style, ColwiseParallel)
            size, what = (module.out_features, "out_features") if rows else (module.in_features, "in_features")
            if size % tp_size:
                raise ConfigError(f"tp_size={tp_size} does not divide {name}.{what}={size} "
                                  f"({type(style).__name__}); pick a tp_size that divides it")


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, object] | None,
                replacements: ParamReplacements) -> set[str]:
    """Apply tensor parallelism to ``model`` on ``tp_mesh`` in place; returns the user plan's keys that matched.

    ``plan``: the user's (``TorchTensorParallelConfig.tp_plan``), else the model's own. Parameters that were tied
    stay tied; ``replacements`` learns the new parameters so optimizers built on the old ones are re-pointed.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if has_dtensor(model):
        logger.info("tensor parallel: %s already holds DTensor parameters; prepare keeps its layout",
                    type(model).__name__)
        return set()
    tp_size = tp_mesh.size()
    chosen = plan if plan is not None else model_plan(model)
    concrete, matched = expand(model, chosen) if chosen else ({}, set())
    if not matched:
        what = "the tp_plan given matches none of its modules" if plan is not None else \
            "it has no tensor-parallel plan (a transformers model carries one in config.base_model_tp_plan)"
        raise ConfigError(f"tp_size={tp_size}: {type(model).__name__} cannot be split: {what}; pass "
                          f"ParallelismConfig(tp_size={tp_size}, tp_handler=TorchTensorParallelConfig(tp_plan="
                          "{'module.path': 'colwise' | 'rowwise' | 'sequence_parallel' | a torch ParallelStyle})) "
                          f"naming its modules (candidates: {_candidates(model)}), or load it already split with "
                          "transformers' from_pretrained(tp_plan='auto')")
    _check_divisible(model, concrete, tp_size)
    owners = ParamReplacements.owners(model)
    parallelize_module(model, tp_mesh, concrete)
    _replicate_rest(model, tp_mesh)
    _retie(owners)
    _grads_like_params(model)
    replacements.record(owners)
    return matched if plan is not None else set()


def _grads_like_params(model: nn.Module) -> None:
    """A gradient that arrives in another layout than its parameter (a tied embedding split by the head's plan:
    the lookup's gradient is replicated, the head's sharded) is put back in the parameter's layout after each
    accumulation: it then takes the parameter's memory, not the full tensor's, and the optimizer sees matching
    shards. (FSDP, applied after tensor parallel, replaces the parameters and reduces their gradients itself.)"""
    from torch.distributed.tensor import DTensor

    def like_param(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    for param in {id(p): p for p in model.parameters()}.values():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(like_param)


def _replicate_rest(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parameters the plan left alone (norms, ...) become replicated DTensors on the tp mesh, their modules taking
    and returning plain tensors (torch's ``distribute_module``), as Accelerate and torchtitan do: every parameter is
    then a DTensor on one mesh, which foreach optimizers, gradient clipping and FSDP's 2-D sharding need (a list
    mixing plain tensors and DTensors fails in torch's foreach kernels)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:
            return  # only the module's own parameters (its children are handled as modules of their own)
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                replicated = distribute_tensor(param.detach(), mesh, [Replicate()], src_data_rank=None)
                module._parameters[key] = nn.Parameter(replicated, requires_grad=param.requires_grad)

    def to_dtensor(module: nn.Module, inputs: tuple[object, ...], mesh: DeviceMesh) -> Any:  # torch types it -> None
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def to_local(module: nn.Module, outputs: object, mesh: DeviceMesh) -> Any:
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs

    owners = [m for m in model.modules()
              if any(p is not None and not isinstance(p, DTensor) for p in m._parameters.values())]
    for module in owners:
        distribute_module(module, tp_mesh, partition, to_dtensor, to_local)


def _retie(owners: list[tuple[nn.Parameter, nn.Module, str]]) -> None:
    """A parameter shared by several modules (tied embeddings) was distributed once per module: share one again."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for old, module, name in owners:
        groups.setdefault(id(old), []).append((module, name))
    for places in groups.values():
        if len(places) < 2:
            continue
        new = [p for module, name in places if (p := module._parameters[name]) is not None]
        first = new[0]
        if all(p is first for p in new):
            continue
        layouts = {(type(p).__name__, tuple(getattr(p, "placements", ())), tuple(p.shape)) for p in new}
        if len(layouts) > 1:
            names = ", ".join(f"{type(m).__name__}.{n}" for m, n in places)
            raise ConfigError(f"tied parameters ({names}) would be split differently by the tensor-parallel plan "
                              f"({sorted(str(x) for x in layouts)}); give the tied modules the same style (e.g. "
                              "embedding_rowwise with colwise_rep) or untie them")
        for module, name in places:
            module._parameters[name] = first


def check_user_plan(plan: Mapping[str, object] | None, matched: set[str], models: Iterable[nn.Module]) -> None:
    """Every key of a user plan names a module of at least one of the models prepared together."""
    if plan is None:
        return
    missing = [key for key in plan if key not in matched]
    if missing:
        candidates = "; ".join(f"{type(m).__name__}: {_candidates(m)}" for m in models)
        raise ConfigError(f"tp_plan key(s) {', '.join(repr(k) for k in missing)} name no module of the prepared "
                          f"model(s) ('*' matches one path component); candidates: {candidates}")


def total_grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all gradients as one vector over every rank's shards: DTensor gradients are reduced across their
    mesh (grouped by mesh: FSDP x TP puts TP'd and plain parameters on different ones), plain ones are local
    (replicated), and the parts combine like one vector."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[int, list[torch.Tensor]] = {}
    plain = []
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault(id(g.device_mesh), []).append(g)
        else:
            plain.append(g)
    parts = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if plain:
        parts.append(torch.nn.utils.get_total_norm(plain, norm_type))
    if not parts:
        return torch.tensor(0.0)
    stacked = torch.stack([p.float().to(parts[0].device) for p in parts])
    return stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)


def clip_by_total_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip by the norm over every rank's shards (:func:`total_grad_norm`): the same total on every rank."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm([p.grad for p in params if p.grad is not None], float(norm_type))
    groups: dict[int | None, list[torch.Tensor]] = {}
    for p in params:  # torch's foreach kernels take one kind of tensor (and one mesh) per call
        grad = p.grad
        groups.setdefault(id(grad.device_mesh) if isinstance(grad, DTensor) else None, []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
