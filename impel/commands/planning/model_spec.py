"""Build a model on the meta device (no weights read, no memory used) from a command-line spec.

Accepted specs:

* a local directory with a transformers ``config.json`` (a saved model or just its config);
* a transformers config class with keyword arguments: ``"GPT2Config(n_layer=12, n_embd=768)"``;
* ``"package.module:callable"`` returning an ``nn.Module`` (called with no arguments).
"""
from __future__ import annotations

import ast
import importlib
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from impel.commands.planning.estimate import ModelFacts, TensorParallelFacts
from impel.config.run_config import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def _config_call(spec: str) -> tuple[str, dict[str, object]] | None:
    try:
        node = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Name):
        return node.id, {}
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    try:
        return node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:
        raise ConfigError(f"model spec {spec!r}: config arguments must be literals (numbers, strings)") from None


def _from_transformers_config(config: PretrainedConfig) -> torch.nn.Module:
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls._from_config(config)
    for auto in ("AutoModelForCausalLM", "AutoModel"):
        try:
            return getattr(transformers, auto).from_config(config)
        except ValueError:
            continue
    raise ConfigError(f"no transformers model class builds {type(config).__name__}; pass module:callable instead")


def _built(factory: object, spec: str) -> torch.nn.Module:
    """``factory()`` of a module:callable spec: a Python function or class taking no arguments that returns a
    ``torch.nn.Module`` (a builtin such as ``os:system`` is not called)."""
    import inspect

    from torch import nn

    usage = "module:callable must name a function or class that takes no arguments and returns a torch.nn.Module"
    if not callable(factory) or inspect.isbuiltin(factory):
        raise ConfigError(f"model spec {spec!r} names {type(factory).__name__} {factory!r}, not a model factory; "
                          f"{usage}")
    try:
        model = factory()
    except TypeError as exc:
        raise ConfigError(f"model spec {spec!r}: calling it failed ({exc}); {usage}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model spec {spec!r} returned {type(model).__name__}, not a torch.nn.Module; {usage}")
    return model


def build_meta_model(spec: str) -> tuple[torch.nn.Module, str]:
    """(model on the meta device, a display name)."""
    import torch

    with torch.device("meta"):
        if os.path.isdir(spec):
            if not os.path.isfile(os.path.join(spec, "config.json")):
                raise ConfigError(f"{spec!r} has no config.json; pass a transformers model directory")
            from transformers import AutoConfig

            return _from_transformers_config(AutoConfig.from_pretrained(spec)), os.path.basename(spec.rstrip("/"))
        if ":" in spec and "(" not in spec:
            module_name, _, attr = spec.partition(":")
            try:
                factory = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"model spec {spec!r} cannot be imported ({exc}); use "
                                  "package.module:callable") from None
            return _built(factory, spec), spec
        call = _config_call(spec)
        if call is None or not call[0].endswith("Config"):
            raise ConfigError(f"model spec {spec!r} is not a directory, a config class such as "
                              "'GPT2Config(n_layer=12)' or module:callable")
        import transformers

        cls = getattr(transformers, call[0], None)
        if cls is None:
            raise ConfigError(f"transformers has no {call[0]!r}; check the spelling (e.g. GPT2Config, LlamaConfig)")
        try:
            return _from_transformers_config(cls(**call[1])), spec
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers and huggingface_hub raise their own types
            raise ConfigError(f"model spec {spec!r} is refused by transformers: {_reason(exc)}; fix the "
                              "arguments (see the class's documentation for valid values)") from None


def _reason(exc: BaseException) -> str:
    """The innermost cause's first line (huggingface_hub wraps a config's ValueError in a validation error)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = str(exc).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(exc).__name__


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def model_tp_plan(model: torch.nn.Module) -> dict[str, object] | None:
    """The tensor-parallel plan a transformers model carries, with full module paths: the one impel's tensor
    parallel applies (``strategies.tensor_parallel.model_plan``: the model's merged plan, task head included,
    else its config's ``base_model_tp_plan`` under the base model's prefix). None without a plan."""
    from impel.strategies.tensor_parallel import model_plan

    return model_plan(model)


# transformers' style names (transformers.distributed.tensor_parallel) and torch's ParallelStyle classes
_COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "local_colwise", "colwiseparallel"}
_ROWWISE = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "local_rowwise", "rowwiseparallel"}
_EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
_SEQUENCE = {"sequence_parallel", "sequenceparallel"}
_NO_PARAMETERS = {"replicate", "replicated_with_grad_allreduce", "all_reduce", "gather", "preparemoduleinput",
                  "preparemoduleoutput", "preparemoduleinputoutput"} | _SEQUENCE


def _style_name(style: object) -> str:
    return style.lower() if isinstance(style, str) else type(style).__name__.lower()


def _split_dim(style: str, module: torch.nn.Module, param: str) -> int | None:
    """The dimension of ``module.<param>`` the style splits, or None when the parameter stays whole."""
    import torch

    if style in _EMBEDDING:
        return _EMBEDDING[style] if param == "weight" else None
    embedding = isinstance(module, torch.nn.Embedding)
    if style in _COLWISE:  # torch's ColwiseParallel: Linear Shard(0) weight and bias, Embedding Shard(1)
        return (1 if embedding else 0) if param == "weight" or (param == "bias" and not embedding) else None
    if style in _ROWWISE:  # RowwiseParallel: Linear Shard(1) weight, bias replicated; Embedding Shard(0)
        return (0 if embedding else 1) if param == "weight" else None
    return None


def tensor_parallel_facts(model: Any, plan: Mapping[str, object], source: str) -> TensorParallelFacts:
    """Which parameters ``plan`` ({module path pattern: style}) splits, with the sizes that tp_size must divide."""
    import torch

    patterns = [(re.compile(r"[^.]+".join(map(re.escape, key.split("*")))), style) for key, style in plan.items()]
    split: dict[int, int] = {}  # id(parameter) -> numel
    dims: dict[int, str] = {}  # size of a split dimension -> the first parameter split along it
    replicated: list[tuple[str, str]] = []
    sequence = logits = False
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, module in model.named_modules():
        style = next((st for rx, st in patterns if rx.fullmatch(path)), None)
        if style is None:
            continue
        name = _style_name(style)
        sequence |= name in _SEQUENCE
        found = False
        for pname, p in module.named_parameters(recurse=False):
            dim = _split_dim(name, module, pname) if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) \
                else None
            if dim is not None:
                split[id(p)] = p.numel()
                dims.setdefault(p.shape[dim], f"{path}.{pname}")
                found = True
        if not found and name not in _NO_PARAMETERS and any(True for _ in module.parameters(recurse=False)):
            replicated.append((path, name))
        if module is output and found:
            # the logits stay split over the vocabulary only when the output layout is a shard (not gathered)
            layout = type(getattr(style, "output_layouts", None)).__name__
            logits = name == "colwise" or (name == "colwiseparallel" and layout == "Shard")
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    units = {(_count(m), sum(split.get(id(p), 0) for p in m.parameters()))
             for m in model.modules() if type(m).__name__ in layer_names}
    units = units or {(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()), sum(split.values()))}
    return TensorParallelFacts(source=source, sharded=sum(split.values()), units=tuple(sorted(units)),
                               split_dims=tuple((where, size) for size, where in dims.items()),
                               sequence_parallel=sequence, logits_sharded=logits, replicated=tuple(replicated))


def model_facts(model: torch.nn.Module, name: str, tp_plan: Mapping[str, object] | None = None) -> ModelFacts:
    """Parameter counts (tied weights once), the transformer shape when the model has a config, and what its
    tensor-parallel plan splits (``tp_plan``, keys relative to ``model``; default: the config's plan)."""
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    units = [_count(m) for m in model.modules() if type(m).__name__ in layer_names]
    cfg = getattr(model, "config", None)

    def pick(*names: str) -> int | None:
        return next((getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)), None)
    plan, source = (tp_plan, "the tp_plan passed") if tp_plan else (model_tp_plan(model), "the model's tp plan")
    return ModelFacts(name=name, params=params, largest_unit=max(units) if units else params,
                      layers=pick("num_hidden_layers", "n_layer"), hidden=pick("hidden_size", "n_embd"),
                      heads=pick("num_attention_heads", "n_head"), vocab=pick("vocab_size"),
                      kv_heads=pick("num_key_value_heads"),
                      tp=tensor_parallel_facts(model, plan, source) if plan else None)
