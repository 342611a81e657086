"""N-D parallelism: :class:`ParallelismConfig` (Accelerate 1.15's, modelled on torchtitan's ``ParallelDims``) and
its handlers, :class:`TorchTensorParallelConfig` and :class:`TorchContextParallelConfig`; Accelerate's deprecated
:class:`TorchTensorParallelPlugin` maps onto it.

The sizes describe one ``DeviceMesh`` with the dims ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp`` (outermost to
innermost; a dim of size 1 is left out), plus the flattened sub-meshes ``dp`` (replicate x shard: the ranks that
see different batches), ``dp_shard_cp`` (what FSDP shards over) and ``dp_cp`` (what a loss is averaged over).

A size left at None takes ``$PARALLELISM_CONFIG_<NAME>`` (Accelerate's launcher variables: ``impel launch``
exports its ``parallelism_config`` section, ``--parallelism_config_tp_size``, as them, like ``accelerate launch``),
else 1. The Accelerator settles the sizes against the world size before anything is built (:func:`settle`): their
product must equal it; a config whose sizes are all 1 becomes plain data parallelism over every rank.

Example::

    pc = ParallelismConfig(dp_shard_size=2, tp_size=2)          # 4 ranks: FSDP x TP
    acc = Accelerator(parallelism_config=pc, fsdp_plugin=FullyShardedDataParallelPlugin())
    model = acc.prepare(model)    # TP from the model's plan on mesh["tp"], then FSDP2 on mesh["dp_shard_cp"]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from impel.config import environment as env
from impel.config.mesh_sizes import (
    MESH_ORDER,
    SIZES,
    ParallelismSection,
    check_strategy,
    check_world_size,
    total_size,
)
from impel.config.plugins import by_hand, config_backed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from impel.config.schema import ConfigError, coerce

logger = logging.getLogger("impel")

# the names a plan may use (transformers' spellings); impel.strategies.tensor_parallel maps each to torch's style
PLAN_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
               "embedding_rowwise", "embedding_colwise", "sequence_parallel", "replicate")


@dataclass
class TorchTensorParallelConfig:
    """Tensor parallelism settings (``ParallelismConfig(tp_handler=...)``).

    ``tp_plan`` (impel's; Accelerate takes plans only through transformers' ``from_pretrained(tp_plan=...)``): the
    plan for models that carry none, ``{"module.path": style}`` with ``*`` for any one path component
    (``"layers.*.mlp.fc1"``) and a style named as in transformers' plans (``"colwise"``, ``"rowwise"``,
    ``"sequence_parallel"``, ... :data:`PLAN_STYLES`) or a torch ``ParallelStyle`` object. A transformers model's own
    plan is used when this is None.

    Example::

        TorchTensorParallelConfig(tp_plan={"net.0": "colwise", "net.2": "rowwise"})
    """

    enable_async_tp: bool = False
    tp_plan: dict[str, object] | None = None

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            raise ConfigError("TorchTensorParallelConfig(enable_async_tp=True) is not supported (Accelerate ignores it "
                              "with a warning); remove it")
        if self.tp_plan is not None:
            check_plan(self.tp_plan)


def check_plan(plan: object) -> None:
    """A plan maps module paths to style names or ParallelStyle objects; a misspelled name fails here."""
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(f"tp_plan={plan!r} must be a non-empty dict of module path -> style, e.g. "
                          "{'layers.*.mlp.fc1': 'colwise', 'layers.*.mlp.fc2': 'rowwise'}")
    for path, style in plan.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(f"tp_plan key {path!r} must be a module path such as 'layers.*.mlp.fc1'")
        if isinstance(style, str) and style not in PLAN_STYLES:
            raise ConfigError(f"tp_plan[{path!r}]={style!r} is not a style impel applies; use one of "
                              f"{', '.join(PLAN_STYLES)} or a torch ParallelStyle object")


@dataclass
class TorchContextParallelConfig:
    """Context parallelism settings (``ParallelismConfig(cp_handler=...)``): ``cp_comm_strategy`` ('allgather' or
    'alltoall'; None takes ``$PARALLELISM_CONFIG_CP_COMM_STRATEGY``, else 'allgather')."""

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        given = self.cp_comm_strategy is not None
        if not given:
            self.cp_comm_strategy = _environment().get("cp_comm_strategy")
        self.cp_comm_strategy = _field_value("cp_comm_strategy", self.cp_comm_strategy or "allgather", from_text=True)
        self.__dict__["_given"] = given


@config_backed(ParallelismSection)
class ParallelismConfig:
    """The sizes of the device mesh, Accelerate's fields and properties (positional order included).

    ``dp_replicate_size`` / ``dp_shard_size`` / ``tp_size`` / ``cp_size`` / ``cp_backend`` / ``sp_size`` /
    ``sp_backend`` are generated from :class:`impel.config.mesh_sizes.ParallelismSection` (the YAML section):
    None takes Accelerate's environment variable (which ``impel launch`` sets from its section), else the default.
    ``sp_size > 1`` (DeepSpeed sequence parallelism) raises.
    """

    tp_handler: TorchTensorParallelConfig | None = by_hand()
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: object = None

    device_mesh = None  # built by get_device_mesh (not a field, as in Accelerate)

    if TYPE_CHECKING:  # the generated keywords (config_backed), settled to values by __post_init__
        dp_replicate_size: int
        dp_shard_size: int
        tp_size: int
        cp_size: int
        cp_backend: str
        sp_size: int
        sp_backend: str

        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def __post_init__(self) -> None:
        given = self._given_section()
        section = ParallelismSection(**given).validate()
        for f in fields(ParallelismSection):
            if f.name != "cp_comm_strategy":
                setattr(self, f.name, getattr(section, f.name))
        self.__dict__["_given"] = given
        if self.sp_handler is not None:
            raise ConfigError("ParallelismConfig(sp_handler=...): DeepSpeed sequence parallelism is not supported "
                              "by impel; remove sp_handler")
        if self.tp_handler is None and self.tp_size > 1:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_handler is None and self.cp_size > 1:
            self.cp_handler = TorchContextParallelConfig(section.cp_comm_strategy)
        for name, cls in (("tp_handler", TorchTensorParallelConfig), ("cp_handler", TorchContextParallelConfig)):
            handler = getattr(self, name)
            if handler is not None and not isinstance(handler, cls):
                raise ConfigError(f"ParallelismConfig({name}={handler!r}) must be a {cls.__name__}")
        self._sizes = {dim: getattr(self, f"{dim}_size") for dim in MESH_ORDER}

    def _given_section(self) -> dict[str, Any]:
        """The section values set here: the keywords given, then Accelerate's variables for the others."""
        out: dict[str, object] = {}
        variables = _environment()
        for f in fields(ParallelismSection):
            if f.name == "cp_comm_strategy":
                continue
            value = getattr(self, f.name)
            if value is None and f.name in variables:
                value = _field_value(f.name, variables[f.name], from_text=True)
            if value is not None:
                out[f.name] = _field_value(f.name, value)
        handler = self.cp_handler
        if isinstance(handler, TorchContextParallelConfig) and handler.__dict__.get("_given"):
            out["cp_comm_strategy"] = handler.cp_comm_strategy
        elif "cp_comm_strategy" in variables:
            out["cp_comm_strategy"] = _field_value("cp_comm_strategy", variables["cp_comm_strategy"], from_text=True)
        return out

    def code_arguments(self) -> dict[str, object]:
        """What this config adds to the Accelerator's code arguments (merged over the launched config)."""
        given = {ParallelismSection.PREFIX + k: v for k, v in self.__dict__.get("_given", {}).items()}
        return {"parallelism_config": given} if given else {}

    def to_json(self) -> dict[str, object]:
        """The sizes and backends (Accelerate's method returns nothing; this returns the dict)."""
        return {name: getattr(self, name) for name in (*SIZES, "cp_backend", "sp_backend")}

    # --- Accelerate's properties ----------------------------------------------------------------------------------
    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dims across which data parallelism is applied (ranks that see different batches)."""
        return [d for d, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled)) if on]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dims whose ranks receive the same batch."""
        return [d for d, on in (("tp", self.tp_enabled), ("cp", self.cp_enabled), ("sp", self.sp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dims flattened into the joint mesh FSDP shards the model over."""
        return [d for d, on in (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dims across which a loss is averaged."""
        return self.dp_dim_names + (["cp"] if self.cp_enabled else [])

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The dims FSDP is applied across: dp_replicate (HSDP) and the joint dp_shard_cp."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def total_size(self) -> int:
        return total_size(self.sizes())

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SIZES}

    def data_parallel_coordinates(self, rank: int) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size) of a global rank: the ranks of one data-parallel rank (its TP
        and CP ranks, the innermost dims of the mesh) read the same batch (``mesh["dp"]``'s local rank)."""
        return rank // self.non_data_parallel_size, self.data_parallel_size

    # --- the mesh -------------------------------------------------------------------------------------------------
    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]] | tuple[()]:
        """(dim names, shape) in torchtitan's order, enabled dims only; () when none is."""
        dims = [d for d in MESH_ORDER if d in self.active_mesh_dims]
        return (tuple(dims), tuple(self._sizes[d] for d in dims)) if dims else ()

    def build_device_mesh(self, device_type: str) -> DeviceMesh | None:
        """The ``DeviceMesh`` with the enabled dims and the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp``; None when
        no dim is enabled (one process)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self._get_mesh()
        if not mesh:
            return None
        names, shape = mesh
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        flattened = {}
        for flat, dims in (("dp", self.dp_dim_names), ("dp_shard_cp", self.dp_shard_cp_dim_names),
                           ("dp_cp", self.dp_cp_dim_names)):
            if dims:
                flattened[flat] = device_mesh[tuple(dims)]._flatten(flat)
        self.__dict__["_flattened"] = (device_mesh, flattened)  # torch asks callers to keep flattened meshes
        return device_mesh

    def submesh(self, *names: str) -> Any:
        """The sub-mesh over ``names`` (impel's): a flattened one (``dp``, ``dp_shard_cp``, ``dp_cp``) as built,
        since torch deprecates slicing those from the root mesh; others sliced (``submesh("tp")``)."""
        mesh = self.get_device_mesh()
        root, flattened = self.__dict__.get("_flattened", (None, {}))
        if len(names) == 1 and names[0] in flattened and root is mesh:
            return flattened[names[0]]
        return mesh[names[0] if len(names) == 1 else tuple(names)]

    @property
    def fsdp_mesh_dim_names(self) -> list[str]:
        """The mesh dims FSDP shards over without a flattened dim where none is needed (no context parallelism):
        ``dp_shard`` (with ``dp_replicate`` first: HSDP); with ``cp``, :attr:`fsdp_dim_names`."""
        if self.cp_enabled:
            return self.fsdp_dim_names
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard"]

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh, built on first call for ``device_type`` ('cuda', 'cpu'); a later call for another type raises."""
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError("ParallelismConfig.get_device_mesh() builds the mesh on first use: pass a "
                                  "device_type such as 'cuda' or 'cpu'")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(f"the device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}")
        return self.device_mesh

    def _set_size(self, parallelism: str, size: int) -> None:
        if parallelism not in self._sizes:
            raise ConfigError(f"parallelism={parallelism!r} is not one of {', '.join(self._sizes)}")
        self._sizes[parallelism] = size
        setattr(self, f"{parallelism}_size", size)


def _field_value(name: str, value: object, from_text: bool = False) -> Any:
    meta = next(f.metadata for f in fields(ParallelismSection) if f.name == name)
    return coerce(name, value, meta, from_text=from_text)


def _environment() -> dict[str, str]:
    """Accelerate's launcher variables for the section's fields (``PARALLELISM_CONFIG_TP_SIZE`` -> tp_size)."""
    return env.parallelism_variables([f.name for f in fields(ParallelismSection)])


def requested(given: ParallelismConfig | None) -> ParallelismConfig | None:
    """The config the code asks for: the one given, else ``ParallelismConfig()`` when Accelerate's launcher turned it
    on (``ACCELERATE_USE_PARALLELISM_CONFIG=true``), else None."""
    if given is not None:
        if not isinstance(given, ParallelismConfig):
            raise ConfigError(f"parallelism_config={given!r} must be an impel.ParallelismConfig")
        return given
    return ParallelismConfig() if env.read_flag("ACCELERATE_USE_PARALLELISM_CONFIG") else None


def settle(section: ParallelismSection | None, given: ParallelismConfig | None, world_size: int,
           distributed_type: str, fsdp_strategy: str | None) -> ParallelismConfig | None:
    """The run's ParallelismConfig, checked against the world size and the strategy (None when neither the code nor
    the launch config asks for one). Sizes that are all 1 spread plain data parallelism over every rank (FSDP:
    dp_shard, else dp_replicate), as Accelerate does for DDP."""
    if section is None and given is None:
        return None
    values = {f.name: getattr(section, f.name) for f in fields(ParallelismSection)} if section is not None else {}
    sizes = {name: values.get(name, 1) for name in SIZES}
    if total_size(sizes) == 1 and world_size > 1:
        sizes["dp_shard_size" if distributed_type == "FSDP" else "dp_replicate_size"] = world_size
    check_world_size(sizes, world_size)
    check_strategy(sizes, distributed_type)
    if fsdp_strategy == "NO_SHARD":
        raise ConfigError("fsdp_sharding_strategy='NO_SHARD' has no place in a parallelism_config mesh; for plain "
                          "replication run MULTI_CPU / MULTI_GPU (DDP), or use FULL_SHARD / SHARD_GRAD_OP")
    if fsdp_strategy and fsdp_strategy.startswith("HYBRID") and sizes["dp_replicate_size"] == 1:
        raise ConfigError(f"fsdp_sharding_strategy={fsdp_strategy!r} replicates over dp_replicate_size, which is 1 "
                          "in the parallelism_config; set parallelism_config_dp_replicate_size (e.g. the number of "
                          "machines) with dp_shard_size, or use FULL_SHARD")
    handlers = {name: getattr(given, name) for name in ("tp_handler", "cp_handler")} if given is not None else {}
    extra = {k: values[k] for k in ("cp_backend", "sp_backend") if k in values}
    settled = ParallelismConfig(**sizes, **extra, **handlers)
    if "cp_comm_strategy" in values and settled.cp_handler is not None and handlers.get("cp_handler") is None:
        settled.cp_handler = TorchContextParallelConfig(values["cp_comm_strategy"])
    for dim, name in (("tp", "tp_handler"), ("cp", "cp_handler")):
        if settled._sizes[dim] == 1 and handlers.get(name) is not None:
            logger.warning("ParallelismConfig.%s is set but %s_size is 1: it has no effect", name, dim)
    if given is None:
        return settled
    # as Accelerate: the object passed in is the run's (settled in place; its get_device_mesh gives the run's mesh)
    if given.device_mesh is not None and given.sizes() != settled.sizes():
        given.device_mesh = None
    for name in (*SIZES, "cp_backend", "sp_backend", "tp_handler", "cp_handler"):
        setattr(given, name, getattr(settled, name))
    given._sizes = dict(settled._sizes)
    return given


class TorchTensorParallelPlugin:
    """Accelerate's deprecated tensor-parallel plugin: ``Accelerator(torch_tp_plugin=TorchTensorParallelPlugin(
    tp_size=2))`` is ``Accelerator(parallelism_config=ParallelismConfig(tp_size=2))``, which replaces it (a
    FutureWarning says so, as Accelerate's). impel builds the mesh itself: a ``torch_device_mesh`` given here raises."""

    def __init__(self, tp_size: int = 1, torch_device_mesh: Any = None) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"TorchTensorParallelPlugin(tp_size={tp_size!r}) must be a whole number >= 1")
        if torch_device_mesh is not None:
            raise ConfigError("TorchTensorParallelPlugin(torch_device_mesh=...): impel builds the device mesh from "
                              "the sizes; pass parallelism_config=ParallelismConfig(tp_size=...) instead")
        self.tp_size = tp_size
        self.torch_device_mesh = None

    def __repr__(self) -> str:
        return f"TorchTensorParallelPlugin(tp_size={self.tp_size})"

    def parallelism_config(self) -> ParallelismConfig:
        """The ``ParallelismConfig`` that replaces this plugin."""
        return ParallelismConfig(tp_size=self.tp_size)
