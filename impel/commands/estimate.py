"""``impel estimate-memory MODEL``: per-rank training memory for every strategy, and the cheapest that fits."""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

from impel.commands.flags import add_field_flag
from impel.config.run_config import ConfigError

_MESH_FLAGS = {
    "dp_replicate_size": "ranks holding full copies of the (sharded) model: HSDP's replicas, or DDP alone",
    "dp_shard_size": "ranks FSDP2 shards the model over (with cp_size: over dp_shard x cp)",
    "tp_size": "tensor parallel ranks: the parameters the model's plan splits hold 1/tp_size each",
    "cp_size": "context parallel ranks: the sequence (and its activations) is split over them (CUDA only in torch)",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("estimate-memory", help="per-rank training memory of a model under every strategy",
                              description="Builds MODEL on the meta device (no weights read) and prints per-rank "
                                          "bytes for parameters, gradients, optimizer states and activations.")
    p.add_argument("model", metavar="MODEL", help="a transformers model/config directory, a config class such as "
                   "'GPT2Config(n_layer=12)', or package.module:callable")
    add_field_flag(p, "num_processes", default=None, help="the number of ranks (default: the product of the "
                   "parallelism sizes below, 1 without them)")
    add_field_flag(p, "num_machines", default=1)
    add_field_flag(p, "mixed_precision", default="no")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="the dtype the model is "
                   "loaded in (from_pretrained(torch_dtype=...))")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd_momentum", "adagrad", "rmsprop"),
                   default="adamw")
    p.add_argument("--batch_size", type=int, default=None, help="per-rank batch for the activation estimate")
    p.add_argument("--seq_len", type=int, default=None, help="sequence length for the activation estimate")
    add_field_flag(p, "device_memory", default=None, help="memory per device, e.g. 80GB or 24GiB")
    mesh = p.add_argument_group("parallelism (a ParallelismConfig mesh, Accelerate's sizes; any of them set: one row "
                                "for that mesh instead of one per strategy)")
    for size, what in _MESH_FLAGS.items():
        mesh.add_argument(f"--{size}", f"--parallelism_config_{size}", dest=size, type=int, default=1, metavar="INT",
                          help=what)
    mesh.add_argument("--tp_plan", default=None, metavar="JSON", help="tensor-parallel plan for a model whose config "
                      "has none: '{\"module.path\": \"colwise\" | \"rowwise\" | ...}', paths relative to MODEL, * "
                      "for a layer index (default: the config's base_model_tp_plan)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=main)


def plan(model: str, setup_kwargs: dict[str, Any], device_memory: str | None,
         tp_plan: dict[str, str] | None = None) -> dict[str, Any]:
    """Estimate every strategy for MODEL, or the one mesh ``setup_kwargs`` names (tp_size, ...); the result the
    command prints (and ``--strategy auto`` uses)."""
    from impel.commands.planning.estimate import Setup, estimate_all, human, parse_bytes, recommend
    from impel.commands.planning.model_spec import build_meta_model, model_facts

    setup = Setup(**setup_kwargs)
    if setup.world < 1 or setup.world % max(setup.machines, 1):
        raise ConfigError(f"--num_processes {setup.world} must be a positive multiple of --num_machines "
                          f"{setup.machines}")
    try:
        limit = parse_bytes(device_memory) if device_memory else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    module, name = build_meta_model(model)
    facts = model_facts(module, name, tp_plan=tp_plan)
    if setup.mesh:  # the mesh asked for, one row: fits or not
        from impel.commands.planning.mesh import check_mesh, estimate_mesh

        check_mesh(facts, setup)
        estimates = [estimate_mesh(facts, setup)]
        best, why = recommend(estimates, limit)
        need = human(estimates[0].device_total)
        if limit is not None:
            why = (f"{estimates[0].strategy} fits: {need} per rank <= {human(limit)}" if best else
                   f"{estimates[0].strategy} needs {need} per rank, more than {human(limit)}: raise dp_shard_size "
                   "or tp_size (cp_size for activations), or lower the batch size or sequence length")
    else:
        estimates = estimate_all(facts, setup)
        best, why = recommend(estimates, limit)
    return {"model": name, "params": facts.params, "largest_unit": facts.largest_unit, "setup": vars(setup),
            "device_memory": limit, "rows": [e.row(limit) for e in estimates],
            "recommended": best.strategy if best else None, "why": why,
            "notes": estimates[0].notes if setup.mesh else []}


def _table(rows: list[dict[str, object]]) -> str:
    cols = list(rows[0])
    cells = [[("-" if v is None else ("yes" if v is True else "no") if isinstance(v, bool) else
               f"{v:.2f}" if isinstance(v, float) else str(v)) for v in (r[c] for c in cols)] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
              for row in cells]
    return "\n".join(lines)


def _tp_plan(text: str | None) -> dict[str, str] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values())):
        raise ConfigError(f"--tp_plan {text!r} is not a JSON object of module paths to styles; write it like "
                          "'{\"layers.*.mlp.up_proj\": \"colwise\", \"layers.*.mlp.down_proj\": \"rowwise\"}'")
    return value


def main(ns: argparse.Namespace) -> int:
    sizes = {size: getattr(ns, size) for size in _MESH_FLAGS}
    world = ns.num_processes if ns.num_processes is not None else math.prod(sizes.values())
    result = plan(ns.model, {"world": world, "machines": ns.num_machines,
                             "mixed_precision": ns.mixed_precision, "load_dtype": ns.dtype,
                             "optimizer": ns.optimizer, "batch_size": ns.batch_size, "seq_len": ns.seq_len, **sizes},
                  ns.device_memory, tp_plan=_tp_plan(ns.tp_plan))
    if ns.json:
        print(json.dumps(result, indent=2))
        return 0
    setup = result["setup"]
    print(f"{result['model']}: {result['params'] / 1e6:.1f}M parameters "
          f"(largest unit {result['largest_unit'] / 1e6:.1f}M), "
          f"{setup['world']} rank(s) on {setup['machines']} machine(s), load dtype {setup['load_dtype']}, "
          f"mixed_precision={setup['mixed_precision']}, {setup['optimizer']}")
    print(_table(result["rows"]))
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"GB per rank on the device; cpu_GB is what offload keeps in CPU RAM. {result['why']}")
    return 0
