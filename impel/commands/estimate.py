"""``impel estimate-memory MODEL``: per-rank training memory for every strategy, and the cheapest that fits."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import ConfigError
from .flags import add_field_flag


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("estimate-memory", help="per-rank training memory of a model under every strategy",
                              description="Builds MODEL on the meta device (no weights read) and prints per-rank "
                                          "bytes for parameters, gradients, optimizer states and activations.")
    p.add_argument("model", metavar="MODEL", help="a transformers model/config directory, a config class such as "
                   "'GPT2Config(n_layer=12)', or package.module:callable")
    add_field_flag(p, "num_processes", default=1)
    add_field_flag(p, "num_machines", default=1)
    add_field_flag(p, "mixed_precision", default="no")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="the dtype the model is "
                   "loaded in (from_pretrained(torch_dtype=...))")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd_momentum", "adagrad", "rmsprop"),
                   default="adamw")
    p.add_argument("--batch_size", type=int, default=None, help="per-rank batch for the activation estimate")
    p.add_argument("--seq_len", type=int, default=None, help="sequence length for the activation estimate")
    add_field_flag(p, "device_memory", default=None, help="memory per device, e.g. 80GB or 24GiB")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=main)


def plan(model: str, setup_kwargs: dict[str, Any], device_memory: str | None) -> dict[str, Any]:
    """Estimate every strategy for MODEL; the result the command prints (and ``--strategy auto`` uses)."""
    from ..planning.estimate import Setup, estimate_all, parse_bytes, recommend
    from ..planning.model_spec import build_meta_model, model_facts

    setup = Setup(**setup_kwargs)
    if setup.world < 1 or setup.world % max(setup.machines, 1):
        raise ConfigError(f"--num_processes {setup.world} must be a positive multiple of --num_machines "
                          f"{setup.machines}")
    try:
        limit = parse_bytes(device_memory) if device_memory else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    module, name = build_meta_model(model)
    facts = model_facts(module, name)
    estimates = estimate_all(facts, setup)
    best, why = recommend(estimates, limit)
    return {"model": name, "params": facts.params, "largest_unit": facts.largest_unit, "setup": vars(setup),
            "device_memory": limit, "rows": [e.row(limit) for e in estimates],
            "recommended": best.strategy if best else None, "why": why}


def _table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    cells = [[("-" if v is None else ("yes" if v is True else "no") if isinstance(v, bool) else
               f"{v:.2f}" if isinstance(v, float) else str(v)) for v in (r[c] for c in cols)] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
              for row in cells]
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    result = plan(ns.model, {"world": ns.num_processes, "machines": ns.num_machines,
                             "mixed_precision": ns.mixed_precision, "load_dtype": ns.dtype,
                             "optimizer": ns.optimizer, "batch_size": ns.batch_size, "seq_len": ns.seq_len},
                  ns.device_memory)
    if ns.json:
        print(json.dumps(result, indent=2))
        return 0
    setup = result["setup"]
    print(f"{result['model']}: {result['params'] / 1e6:.1f}M parameters "
          f"(largest unit {result['largest_unit'] / 1e6:.1f}M), "
          f"{setup['world']} rank(s) on {setup['machines']} machine(s), load dtype {setup['load_dtype']}, "
          f"mixed_precision={setup['mixed_precision']}, {setup['optimizer']}")
    print(_table(result["rows"]))
    print(f"GB per rank on the device; cpu_GB is what offload keeps in CPU RAM. {result['why']}")
    return 0
