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
from typing import Any

from ..config import ConfigError
from .estimate import ModelFacts


def _config_call(spec: str) -> tuple[str, dict[str, Any]] | None:
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


def _from_transformers_config(config: Any) -> Any:
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


def build_meta_model(spec: str) -> tuple[Any, str]:
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
            return factory(), spec
        call = _config_call(spec)
        if call is None or not call[0].endswith("Config"):
            raise ConfigError(f"model spec {spec!r} is not a directory, a config class such as "
                              "'GPT2Config(n_layer=12)' or module:callable")
        import transformers

        cls = getattr(transformers, call[0], None)
        if cls is None:
            raise ConfigError(f"transformers has no {call[0]!r}; check the spelling (e.g. GPT2Config, LlamaConfig)")
        return _from_transformers_config(cls(**call[1])), spec


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def model_facts(model: Any, name: str) -> ModelFacts:
    """Parameter counts (tied weights once) and the transformer shape when the model has a config."""
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    units = [_count(m) for m in model.modules() if type(m).__name__ in layer_names]
    cfg = getattr(model, "config", None)

    def pick(*names: str) -> int | None:
        return next((getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)), None)
    return ModelFacts(name=name, params=params, largest_unit=max(units) if units else params,
                      layers=pick("num_hidden_layers", "n_layer"), hidden=pick("hidden_size", "n_embd"),
                      heads=pick("num_attention_heads", "n_head"), vocab=pick("vocab_size"))
