"""Habits that keep the architecture, checked statically (AST only: nothing under ``impel/`` is imported).

- Only ``impel/config/environment.py`` reads or writes the environment (``os.environ``, ``os.getenv``, ``os.putenv``,
...).
- No module under ``impel/`` is longer than 500 lines.
- impel's modules import each other without cycles.
- Each module sits in a layer (docs/design.md, "Layers"; the table there and ``LAYERS`` here must agree) and
  imports nothing from a higher layer.

What counts as an import of an impel module: every ``import`` / ``from ... import`` anywhere in the file (module
level, under ``if TYPE_CHECKING:``, inside functions), relative or absolute. ``from pkg import name`` is an import of
the submodule ``pkg.name`` when that is a module, else of ``pkg`` itself (its ``__init__``, whose own imports are
edges of the package); a name a package resolves lazily through a literal ``_EXPORTS`` table (``impel``,
``impel.trainer``) counts as an import of the module the table names. Dotted paths in strings (the strategy
registry, ``importlib.import_module``) are not imports, and neither is the implicit import of a module's parent
packages.
"""
from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "impel"
DESIGN = ROOT / "docs" / "design.md"

MAX_LINES = 500

# --- the environment ---------------------------------------------------------------------------------------------
ENV_MODULE = "impel.config.environment"
# Modules allowed to touch os.environ besides impel.config.environment, each with the reason.
ENV_ALLOWED = {
    "impel.testing": "the harness behind run_on_ranks plays the launcher: it copies the caller's whole environment "
                     "into each rank it starts (then RANK / WORLD_SIZE / ...), reading no variable by name, so "
                     "nothing in it configures impel",
}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

# --- layers ------------------------------------------------------------------------------------------------------
# The folders are the layers, bottom to top (docs/design.md, "Layers"; the table there and ``LAYERS`` here must
# agree). ``pkg.*`` is every module of a folder (its __init__ included); ``*`` is every top-level module not named
# on its own (Accelerate's module paths and impel's own entry points: thin faces that nothing in impel imports);
# ``impel`` is the package's own __init__ (the version and the lazy name table). A module may import from its own
# layer and the ones below.
LAYERS = {
    "impel": 0, "exports": 0, "types": 0,
    "config.*": 1,
    "runtime.*": 2,
    "checkpoint.*": 3,
    "strategies.*": 4,
    "trackers.*": 5,
    "accelerator.*": 6,
    "trainer.*": 7,
    "commands.*": 8,
    "utils.*": 9, "*": 9,
}


# --- reading the package -----------------------------------------------------------------------------------------
@functools.cache
def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the impel package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@functools.cache
def tree(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text(encoding="utf-8"), filename=str(modules()[module]))


def _is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


@functools.cache
def lazy_exports() -> dict[str, dict[str, str]]:
    """Module -> {name: module it resolves to} for the literal ``_EXPORTS`` tables of lazy faces."""
    out: dict[str, dict[str, str]] = {}
    for module in modules():
        for node in tree(module).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS"
                                                    for t in node.targets):
                try:
                    table = ast.literal_eval(node.value)
                except ValueError:  # built with comprehensions (impel.utils): not resolved, the face is on top
                    continue
                base = module if _is_package(module) else module.rpartition(".")[0]
                out[module] = {name: target if target.startswith("impel") else f"{base}.{target}"
                               for name, target in table.items()}
    return out


def _known(name: str) -> str | None:
    """``name`` or its longest prefix that is an impel module."""
    while name:
        if name in modules():
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported impel module, line) for every import in ``module``."""
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name) if alias.name.split(".")[0] == "impel" else None
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "impel":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = (sub if sub in modules() else lazy_exports().get(base, {}).get(alias.name) or _known(base))
                if target:
                    yield target, node.lineno


@functools.cache
def graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: first line importing it}; self-imports left out."""
    out: dict[str, dict[str, int]] = {}
    for module in modules():
        edges: dict[str, int] = {}
        for target, line in imports(module):
            if target != module:
                edges.setdefault(target, line)
        out[module] = edges
    return out


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one module (each one or more import cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _where(module: str, line: int) -> str:
    return f"{modules()[module].relative_to(ROOT)}:{line}"


def layer_of(module: str) -> int | None:
    short = "impel" if module == "impel" else module.removeprefix("impel.")
    if short in LAYERS:
        return LAYERS[short]
    parts = short.split(".")
    for cut in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:cut]) + ".*")
        if layer is not None:
            return layer
    return LAYERS["*"] if len(parts) == 1 and not _is_package(module) else None


# --- the checks --------------------------------------------------------------------------------------------------
def environment_uses(module: str) -> list[str]:
    """Where ``module`` touches the process environment through ``os``."""
    os_names = set()
    found = []
    body = tree(module)
    for node in ast.walk(body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "os" or alias.name.startswith("os."):
                    os_names.add(alias.asname or "os")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and not node.level:
            found += [f"{_where(module, node.lineno)} from os import {a.name}" for a in node.names
                      if a.name in ENV_NAMES or a.name == "*"]
    for node in ast.walk(body):
        if (isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name)
                and node.value.id in os_names):
            found.append(f"{_where(module, node.lineno)} {node.value.id}.{node.attr}")
    return found


def test_only_env_reads_the_environment():
    # the probe sees what it looks for
    assert "impel.config.environment" in modules() and environment_uses("impel.config.environment")
    unknown = set(ENV_ALLOWED) - set(modules())
    assert not unknown, f"ENV_ALLOWED names modules that do not exist: {sorted(unknown)}"
    found = [use for m in modules() if m != ENV_MODULE and m not in ENV_ALLOWED for use in environment_uses(m)]
    assert not found, ("only impel/config/environment.py reads or writes the environment; move these into a "
                       "function there (named after what it reads):\n  " + "\n  ".join(found))


# Modules that read the launch config (``IMPEL_CONFIG``) themselves, each with the reason. Everything else gets
# its launched values from resolve() (the run record), once: a value read again elsewhere could disagree with it.
LAUNCH_CONFIG_READERS = {
    "impel.config.environment_settings": "launched_settings(): the one source resolve() reads (and impel env)",
    "impel.runtime.ranks.rank_health": "the stall watchdog starts with the process group, before any Accelerator "
                                       "resolves: it asks only whether the job is elastic (min_machines)",
}


def test_only_resolve_reads_the_launch_config():
    callers = {m for m in modules() if m != ENV_MODULE for node in ast.walk(tree(m))
               if isinstance(node, ast.Attribute | ast.Name)
               and (node.attr if isinstance(node, ast.Attribute) else node.id) == "read_launch_config"}
    assert "impel.config.environment_settings" in callers  # the probe sees what it looks for
    assert callers <= set(LAUNCH_CONFIG_READERS), (
        f"{sorted(callers - set(LAUNCH_CONFIG_READERS))} read IMPEL_CONFIG themselves; take the value from the run "
        "record (resolve) or, for what user code builds before the Accelerator (ParallelismConfig), from the "
        "Accelerate variable impel launch exports")


def test_no_module_is_longer_than_500_lines():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, (f"modules over {MAX_LINES} lines: "
                      + ", ".join(f"{modules()[m].relative_to(ROOT)} ({n})" for m, n in sorted(long.items()))
                      + "; split each by job")


def test_the_import_graph_is_read():  # the other tests are only as good as the graph
    edges = graph()
    assert "impel.config.run_config" in edges["impel.runtime.ranks.process"]
    assert "impel.checkpoint.errors" in edges["impel.checkpoint"]  # a package __init__ re-exporting
    assert "impel.config.deepspeed_json" in edges["impel.trainer.hf_deepspeed"]
    assert lazy_exports()["impel.trainer"]["Trainer"] == "impel.trainer.hf"  # a lazy table's relative names
    assert strongly_connected({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_impel_modules_form_no_import_cycle():
    edges = graph()
    cycles = strongly_connected(edges)
    lines = []
    for component in cycles:
        lines.append(f"{len(component)} modules: {', '.join(component)}")
        lines += [f"    {a} -> {b}  ({_where(a, line)})" for a in component for b, line in sorted(edges[a].items())
                  if b in component]
    assert not cycles, ("import cycles among impel's modules (strongly connected components, with the imports "
                        "inside each; an import under TYPE_CHECKING or inside a function counts):\n"
                        + "\n".join(lines))


def test_a_folders_docstring_names_its_layer():
    """``Layer N`` at the top of a folder's ``__init__`` is the number in ``LAYERS`` (four had drifted by one)."""
    wrong = []
    for folder in sorted(k[:-2] for k in LAYERS if k.endswith(".*")):
        doc = ast.get_docstring(tree(f"impel.{folder}")) or ""
        said = re.match(r"Layer (\d+)", doc)
        if said and int(said.group(1)) != LAYERS[f"{folder}.*"]:
            wrong.append(f"impel/{folder}/__init__.py says layer {said.group(1)}, LAYERS {LAYERS[folder + '.*']}")
    assert not wrong, wrong


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert not missing, f"place these modules in LAYERS (and in docs/design.md, 'Layers'): {missing}"
    stale = sorted(k for k in LAYERS if not k.endswith("*") and ("impel" if k == "impel" else f"impel.{k}")
                   not in modules())
    stale += sorted(k for k in LAYERS if k.endswith(".*") and f"impel.{k[:-2]}" not in modules())
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def _names_a_strategy(node: ast.AST) -> bool:
    """``x.distributed_type`` / ``distributed_type`` or ``DistributedType.FSDP`` (also inside a tuple)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "distributed_type" or (isinstance(node.value, ast.Name)
                                                   and node.value.id == "DistributedType")
    if isinstance(node, ast.Name):
        return node.id == "distributed_type"
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_strategy(e) for e in node.elts)
    return False


# Where a distributed type may be compared, each with the reason: everywhere else behaviour follows the strategy's
# capabilities.
NAMES_A_STRATEGY = {
    "impel.accelerator.resolve": "where a run is resolved: the type picks the strategy",
    "impel.strategies": "the strategies themselves (the registry maps each type to its class)",
    "impel.config": "the run config before any strategy exists: its checks and conversions are about the type",
    "impel.commands": "the launcher plans a config (DeepSpeed's runner, the CPU ranks) before any rank starts",
}


def test_the_faces_ask_strategies_what_they_can_do_never_their_name():
    """No comparison with a distributed type outside :data:`NAMES_A_STRATEGY` (the runtime, checkpoints, trackers,
    the facade, the Trainer): behaviour follows the strategy's capabilities (``whole_model``, ``uses_ddp``,
    ``engine_managed``, ``fsdp2`` on :class:`impel.strategies.base.Strategy`), so a new strategy is found by no grep."""
    found = []
    for module, path in modules().items():
        if any(module == allowed or module.startswith(allowed + ".") for allowed in NAMES_A_STRATEGY):
            continue
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Compare) and any(map(_names_a_strategy, [node.left, *node.comparators])):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "ask the strategy (a capability in strategies/base.py), not its name:\n" + "\n".join(found)


def test_no_module_imports_from_a_higher_layer():
    edges = graph()
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})  ({_where(a, line)})"
              for a in sorted(edges) for b, line in sorted(edges[a].items())
              if (layer_of(a) or 0) < (layer_of(b) or 0)]
    assert not upward, ("a module imports from a higher layer (docs/design.md, 'Layers'); move the shared part "
                        "down, or pass the object in instead of importing its class:\n  " + "\n  ".join(upward))


def documented_layers() -> dict[str, int]:
    """The table under docs/design.md's "## Layers": the backticked names of each row, by layer number."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in re.finditer(r"^\|\s*(\d+)\s*\|([^|]*)\|", section, flags=re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", row.group(2)):
            out[name] = int(row.group(1))
    return out


def test_design_doc_and_test_agree_on_the_layers():
    assert documented_layers() == LAYERS


# --- the Accelerator's private attributes --------------------------------------------------------------------------
# How other modules name an Accelerator: a variable or attribute with one of these names. The facade hands them what
# they need instead (impel.accelerator.prepared.Prepared / TrainingRun, public methods).
ACCELERATOR_NAMES = {"acc", "accelerator", "_accelerator"}


def private_accelerator_reads(module: str) -> list[str]:
    found = []
    for node in ast.walk(tree(module)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
        if name in ACCELERATOR_NAMES:
            found.append(f"{_where(module, node.lineno)}: {ast.unparse(node)}")
    return found


def test_no_module_but_the_facade_reads_an_accelerator_private_attribute():
    reads = [r for m in sorted(modules()) if m != "impel.accelerator.facade" for r in private_accelerator_reads(m)]
    assert reads == [], "read through impel.accelerator.prepared / a public method instead:\n" + "\n".join(reads)


# --- one owner for the accumulation state --------------------------------------------------------------------------
def test_only_the_accumulation_module_writes_the_gradient_state():
    """GradientState's fields change through its methods only (impel/runtime/step/accumulation.py): no other module
    assigns one of its fields, public or private, so the accumulation rules live in one file."""
    owner = "impel.runtime.step.accumulation"
    (cls,) = [n for n in tree(owner).body if isinstance(n, ast.ClassDef) and n.name == "GradientState"]
    fields = {node.attr for node in ast.walk(cls)
              if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"}
    public = {"sync_gradients", "num_steps", "group_size", "micro_in_group", "step", "manual_no_sync",
              "active_dataloaders", "plugin"}
    assert {"_sync", "_micro", "_dataloaders"} <= fields  # the probe sees the owner's fields
    private = {f for f in fields if f.startswith("_")} - {"_plugin"}
    writes = []
    for module in sorted(modules()):
        if module == owner:
            continue
        for node in ast.walk(tree(module)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            writes += [f"{_where(module, node.lineno)}: {ast.unparse(t)}" for t in targets
                       if isinstance(t, ast.Attribute) and t.attr in public | private
                       and isinstance(t.value, ast.Attribute) and t.value.attr == "gradient_state"]
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                writes.append(f"{_where(module, node.lineno)}: {ast.unparse(node)}")
    assert not writes, "change the gradient state through its methods:\n" + "\n".join(writes)


def test_every_strategy_override_keeps_the_base_signature():
    """A strategy that overrides a ``Strategy`` method takes exactly its parameters, with the same annotations (no
    ``options: Any`` against a typed ``SaveOptions``): the facade calls every strategy the same way."""
    import importlib
    import inspect

    from impel.strategies.base import REGISTRY, Strategy

    classes = {getattr(importlib.import_module(t.partition(":")[0]), t.partition(":")[2]) for t in REGISTRY.values()}
    differ = []
    for cls in sorted(classes, key=lambda c: c.__name__):
        for name, member in vars(cls).items():
            base = vars(Strategy).get(name)
            if name.startswith("__") or not callable(member) or not callable(base):
                continue
            if inspect.signature(member) != inspect.signature(base):
                differ.append(f"{cls.__name__}.{name}{inspect.signature(member)} != Strategy.{name}"
                              f"{inspect.signature(base)}")
    assert not differ, "\n".join(differ)


def test_one_lazy_export_implementation():
    """Faces re-export lazily through ``impel.exports.lazy_face`` only (there were four copies of it): no other
    module-level ``__getattr__`` imports modules by name."""
    copies = []
    for module, path in modules().items():
        for node in tree(module).body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and module != "impel.exports":
                calls = {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
                if "importlib.import_module" in calls:
                    copies.append(str(path.relative_to(ROOT)))
    assert not copies, f"use impel.exports.lazy_face instead: {copies}"


def test_no_two_classes_share_a_name():
    """A class name names one class in impel (two ``RunRecord`` classes, a run's record and a Trainer callback, were
    confused by readers); Accelerate's faces that re-export a class by another module's name do not count."""
    seen: dict[str, list[str]] = {}
    for module in modules():
        for node in tree(module).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(module)
    shared = {name: where for name, where in seen.items() if len(where) > 1}
    assert not shared, shared


def test_no_string_names_a_module_of_a_higher_layer():
    """A dotted path in a string (``"impel.x.y:attr"``, imported by name later) is an import the layer test cannot
    see: it may only name the same layer or a lower one (``checkpoint/formats/merge.py`` once reached up into
    ``impel.strategies.deepspeed`` this way). The faces' lazy tables, checked above, are not strings of code."""
    path_string = re.compile(r"^impel(\.\w+)+(:\w+)?$")
    found = []
    for module, path in modules().items():
        mine = layer_of(module)
        tables = {id(n) for node in tree(module).body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
                  for n in ast.walk(node)}
        tables |= {id(arg) for node in ast.walk(tree(module)) if isinstance(node, ast.Call)
                   and ast.unparse(node.func) == "logging.getLogger" for arg in node.args}  # a logger's name
        for node in ast.walk(tree(module)):
            if id(node) in tables:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and path_string.match(node.value):
                target = _known(node.value.partition(":")[0])
                if target and mine is not None and (layer_of(target) or 0) > mine:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value} (layer {layer_of(target)} "
                                 f"from layer {mine})")
    assert not found, "\n".join(found)
