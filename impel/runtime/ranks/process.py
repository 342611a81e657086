"""Process topology: ranks, world size, device, and process-group initialisation from torchrun's variables; and
Accelerate's state objects over it (``PartialState``, ``AcceleratorState``, ``GradientState``).

``python script.py`` without torchrun's variables is one process. With several ranks impel always joins a real
process group (nccl on CUDA, gloo on CPU): it never trains independent replicas by accident.

Example::

    state = PartialState()
    with state.split_between_processes(prompts) as mine:
        outputs = [generate(p) for p in mine]
"""
from __future__ import annotations

import atexit
import logging
import signal
import sys
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from impel.config import environment as env
from impel.config.run_config import ConfigError, DistributedType
from impel.runtime.ranks import collectives, rank_health
from impel.runtime.ranks.process_control import ProcessControl
from impel.runtime.ranks.teardown import release_process_groups
from impel.runtime.step.accumulation import (
    GradientState as GradientState,  # re-exported: impel.runtime.ranks.process.GradientState, as Accelerate's
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from impel.config.parallelism import ParallelismConfig
    from impel.config.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from impel.runtime.step.compile import TorchDynamoPlugin
    from impel.runtime.step.run_record import RunRecord

logger = logging.getLogger("impel")

DEFAULT_TIMEOUT = timedelta(minutes=10)


def pick_device(local_rank: int, cpu: bool) -> torch.device:
    """cuda:LOCAL_RANK, else mps, else cpu; ``cpu=True`` forces the CPU; ``ACCELERATE_TORCH_DEVICE`` names one."""
    named = env.requested_device()
    if named is not None:
        return _named_device(named, local_rank, cpu)
    if not cpu and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                               "visible; launch fewer processes per node or fix CUDA_VISIBLE_DEVICES")
        return torch.device("cuda", local_rank)
    mps = getattr(torch.backends, "mps", None)
    if not cpu and mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _named_device(named: str, local_rank: int, cpu: bool) -> torch.device:
    """``ACCELERATE_TORCH_DEVICE``: ``cpu``, ``cuda`` (cuda:LOCAL_RANK) or ``cuda:N`` (a device this process sees),
    ``mps``; anything else raises naming the value."""
    try:
        device = torch.device(named)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"ACCELERATE_TORCH_DEVICE={named!r} is not a device impel runs on; use cpu, cuda, cuda:N "
                          "or mps, or unset it (impel then picks cuda:LOCAL_RANK, else the CPU)")
    if cpu:
        return torch.device("cpu")
    if device.type == "cpu":
        return device  # cpu:N as given, as Accelerate keeps it
    if device.type == "cuda":
        index = local_rank if device.index is None else device.index
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"ACCELERATE_TORCH_DEVICE={named!r} but this process sees "
                              f"{torch.cuda.device_count()} CUDA devices; fix CUDA_VISIBLE_DEVICES or the variable")
        return torch.device("cuda", index)
    return device


def live_device(cpu: bool) -> torch.device | None:
    """The device of the process state already created in this process (None before the first one); raises when
    ``cpu`` asks for the CPU but the process runs elsewhere."""
    if not ProcessState._shared.get("initialized"):
        return None
    device: torch.device = ProcessState._shared["device"]
    if cpu and device.type != "cpu":
        raise ConfigError(f"cpu=True but this process already runs on {device}; create the first Accelerator with "
                          "cpu=True")
    return device


class ProcessState:
    """One per process: where this rank is, which device it uses, and the default process group.

    Example::

        state = ProcessState()
        print(state.process_index, state.num_processes, state.device)
    """

    _shared: dict[str, Any] = {}
    topology: env.Topology
    device: torch.device

    def __init__(self, cpu: bool = False, backend: str | None = None, timeout: timedelta | None = None,
                 init_method: str | None = None) -> None:
        self.__dict__ = self._shared
        if self._shared.get("initialized"):
            self._check_same(cpu, backend, timeout, init_method)
            return
        topo = env.read_topology()
        self.topology = topo
        self.device = pick_device(topo.local_rank, cpu)
        self.backend: str | None = None
        self.owns_group = False
        self.timeout = timeout or DEFAULT_TIMEOUT
        self.init_method = init_method
        if topo.distributed:
            self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
            self._init_group(init_method)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.initialized = True

    def _check_same(self, cpu: bool, backend: str | None, timeout: timedelta | None, init_method: str | None) -> None:
        """The process (device, process group) is one per process, as Accelerate's PartialState: a later request
        that this process cannot honour raises instead of being ignored."""
        live_device(cpu)  # raises when cpu=True asks for another device than the live one
        if not self.topology.distributed:
            return  # one process joins no group: nothing to disagree with
        asked = {"backend": (backend, self.backend), "timeout": (timeout, self.timeout),
                 "init_method": (init_method, self.__dict__.get("init_method"))}
        for name, (wanted, live) in asked.items():
            if wanted is not None and wanted != live:
                raise ConfigError(f"InitProcessGroupKwargs({name}={wanted!r}) but this process already joined a "
                                  f"process group with {name}={live!r} (set by the first Accelerator or "
                                  "PartialState; the process group is created once per process); pass the same "
                                  "value or leave it out")

    def _init_group(self, init_method: str | None) -> None:
        topo = self.topology
        if dist.is_initialized():
            if dist.get_world_size() != topo.world_size:
                raise RuntimeError(f"a process group of size {dist.get_world_size()} exists but WORLD_SIZE="
                                   f"{topo.world_size}; destroy it or launch consistently")
            return
        if init_method is None and (topo.master_addr is None or topo.master_port is None):
            raise RuntimeError(f"WORLD_SIZE={topo.world_size} but MASTER_ADDR/MASTER_PORT are not set; "
                               "launch with `impel launch` or torchrun")
        if topo.source != "torchrun":
            env.export_topology(topo)  # torch's env:// rendezvous (and scripts) read torchrun's variables
            logger.info("impel: rank %d of %d, placed by %s", topo.rank, topo.world_size, topo.source)
        kwargs: dict[str, Any] = {"backend": self.backend, "timeout": self.timeout,
                                  "rank": topo.rank, "world_size": topo.world_size}
        if init_method:
            kwargs["init_method"] = init_method
        if self.backend == "nccl":
            kwargs["device_id"] = self.device
        if init_method is None and topo.restart_count is not None:
            kwargs["store"] = self._attempt_store(topo)
        dist.init_process_group(**kwargs)
        self._own_group()
        self._joined_barrier()
        rank_health.start_watchdog(kwargs.get("store") or _default_store(), topo.rank, topo.world_size,
                                   self.timeout.total_seconds())
        logger.debug("rank %d/%d joined a %s process group", topo.rank, topo.world_size, self.backend)

    def _joined_barrier(self) -> None:
        """Wait until every rank has joined the group. ``init_process_group`` can return on one rank while a peer
        is still finishing gloo's connection handshake; a rank that then finishes its work and exits at once
        closes its sockets under that peer, whose init fails with "connectFullMesh failed ... Connection closed
        by peer" (seen under load). torch dropped its own barrier after init (``TORCH_DIST_INIT_BARRIER``)."""
        dist.barrier()  # nccl: on the device given to init_process_group as device_id

    def _attempt_store(self, topo: Any) -> dist.PrefixStore:
        """The rendezvous store under torchrun, with a prefix per restart attempt.

        After an elastic restart the store can still hold the previous attempt's keys (the agent keeps its store
        across attempts); gloo then reads a dead rank's address and fails with "Connection refused". A prefix per
        ``TORCHELASTIC_RESTART_COUNT`` makes every attempt's keys its own. Without the agent's store (an elastic
        job: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) rank 0 hosts a new store every attempt, and the agents' restart
        counts differ (a machine that rejoins starts at 0), so the prefix is the same for all.
        """
        host_store = not topo.agent_store and topo.rank == 0
        store = dist.TCPStore(topo.master_addr, topo.master_port, topo.world_size, is_master=host_store,
                              timeout=self.timeout, multi_tenant=True)
        return dist.PrefixStore(f"impel/attempt_{topo.restart_count}" if topo.agent_store else "impel/job", store)

    # --- topology -------------------------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return self.topology.world_size

    @property
    def process_index(self) -> int:
        return self.topology.rank

    @property
    def local_process_index(self) -> int:
        return self.topology.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.topology.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.topology.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.topology.rank == self.topology.world_size - 1

    @property
    def use_distributed(self) -> bool:
        return self.topology.distributed

    def wait_for_everyone(self) -> None:
        if self.use_distributed:
            with rank_health.blocking("wait_for_everyone"):
                dist.barrier()

    def ensure_process_group(self) -> None:
        """A process group of one (nccl on CUDA, gloo otherwise, over an in-memory store) for a single process that
        needs one (FSDP2's mesh, DeepSpeed); impel owns it and destroys it like a launched one."""
        if dist.is_initialized():
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self._own_group()

    def _own_group(self) -> None:
        self.owns_group = True
        atexit.unregister(_destroy_at_exit)
        atexit.register(_destroy_at_exit)

    def destroy_process_group(self, group: dist.ProcessGroup | None = None) -> None:
        """Destroy the default process group if impel created it (a group the script made stays the script's).

        ``Accelerator.end_training()`` calls this after a final barrier, as Accelerate does; impel also calls it
        when the interpreter exits normally, so gloo and nccl shut down while everything is alive instead of in
        the interpreter's teardown; at exit it also releases the references torch objects keep to the group, so
        that gloo's worker threads are joined before the interpreter finalises (see
        :mod:`impel.runtime.ranks.teardown`).
        """
        rank_health.stop_watchdog()
        if group is not None:  # a group the script made with new_group: destroyed as asked, as Accelerate does
            dist.destroy_process_group(group)
            return
        if self.__dict__.get("owns_group") and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled: the process facts, without the (weak) links to live Accelerators."""
        return {k: v for k, v in self.__dict__.items() if k != "accelerator_refs"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (or deep-copied) in a process whose state exists: that state, shared as always; else the
        pickled facts, detached."""
        if ProcessState._shared.get("initialized"):
            self.__dict__ = ProcessState._shared
        else:
            self.__dict__.update(state)

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate's reset, which transformers (``TrainingArguments``, the Trainer, its test utilities) and test
        suites call: forget this process's state, so the next ``PartialState()`` / Accelerator reads the
        environment again. The process group stays alive and is reused, as in Accelerate."""
        shared = ProcessState._shared
        keep = {"owns_group": shared.get("owns_group", False)} if dist.is_initialized() else {}
        shared.clear()
        shared.update(keep)

    @classmethod
    def _reset(cls) -> None:
        """Forget the state (tests only); destroys the process group if this state created one."""
        if cls._shared.get("initialized") and dist.is_initialized():
            dist.destroy_process_group()
        cls._shared.clear()


def _default_store() -> dist.Store | None:
    """The store of the default group (torch keeps it; None where this torch does not say)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - only the stall watchdog needs it
        return None


def _destroy_at_exit() -> None:
    """atexit: destroy impel's process group on a normal exit, then let its C++ object (and gloo's worker threads)
    go while the interpreter is alive (:mod:`impel.runtime.ranks.teardown` says why). After an unhandled exception
    (``sys.last_value`` is set) the group is left alone: a peer may be dead and a teardown could then block.
    The stall watchdog stops in every case: its thread must not be inside a store call when the interpreter
    finalises (the same abort as gloo's workers)."""
    rank_health.stop_watchdog()
    if getattr(sys, "last_value", None) is None and ProcessState._shared.get("initialized"):
        if ProcessState._shared.get("owns_group") and dist.is_initialized() and dist.get_world_size() > 1:
            rank_health.note_normal_exit(dist.get_rank())  # still in the group: its peers may be waiting for it
            # its peers now fail, and the agent stops this rank with SIGTERM: it finishes its exit instead, so the
            # launcher reports the script's own exit code (a sys.exit(3)), not the signal (issue 36)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ProcessState().destroy_process_group()
        release_process_groups()


# --- Accelerate's state objects ---------------------------------------------------------------------------------
# All share ProcessState's one process-wide record, as Accelerate's do: ``PartialState()`` is the process (rank,
# device, process group) with its process-control helpers and needs no Accelerator; ``AcceleratorState()`` adds
# what the live Accelerator resolved (``distributed_type``, ``mixed_precision``, ``deepspeed_plugin``,
# ``fsdp_plugin``, ``dynamo_plugin``). ``GradientState`` is :mod:`impel.runtime.step.accumulation`'s, named here as in
# Accelerate.
def current_topology() -> env.Topology:
    """This process's place in the job: the live state's, else torchrun's variables (nothing is initialised)."""
    shared = ProcessState._shared
    if shared.get("initialized"):
        return shared["topology"]
    return env.read_topology()


class PartialState(ProcessState, ProcessControl):
    """The process: ``process_index``, ``device``, ``wait_for_everyone``, ``main_process_first``,
    ``split_between_processes``, ``on_main_process``, ``print``; joins the process group under torchrun."""

    @property
    def distributed_type(self) -> DistributedType:
        """NO on one process, else MULTI_GPU on CUDA and MULTI_CPU otherwise (``AcceleratorState`` knows more)."""
        if not self.use_distributed:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def default_device(self) -> torch.device:
        return self.device

    @property
    def debug(self) -> bool:
        """Debug mode: collectives first check the shapes on every rank and raise a
        ``DistributedOperationException`` naming them. Set it here, or ``ACCELERATE_DEBUG_MODE=1``."""
        return collectives.debug_mode()

    @debug.setter
    def debug(self, on: bool) -> None:
        collectives.set_debug_mode(bool(on))

    @property
    def fork_launched(self) -> bool:
        """Whether this process was started by a fork-based launcher (``$FORK_LAUNCHED``, as Accelerate)."""
        return env.parse_flag_from_env("FORK_LAUNCHED")

    def set_device(self) -> None:
        """Make this process's device the current CUDA device (nothing to do elsewhere); the state already did at
        creation, as Accelerate's does."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)


def is_initialized() -> bool:
    """Whether this process's state exists (a ``PartialState`` or an Accelerator was created)."""
    return bool(ProcessState._shared.get("initialized"))


class SettledAccelerator(Protocol):
    """What ``AcceleratorState`` reads of the Accelerator that built it (its resolved settings)."""

    @property
    def record(self) -> RunRecord: ...
    @property
    def distributed_type(self) -> DistributedType: ...
    @property
    def mixed_precision(self) -> str: ...
    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None: ...
    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin | None: ...
    @property
    def is_fsdp2(self) -> bool: ...
    @property
    def parallelism_config(self) -> ParallelismConfig | None: ...
    @property
    def torch_device_mesh(self) -> DeviceMesh | None: ...


class AcceleratorState(PartialState):
    """``PartialState`` plus the settings the live Accelerator resolved; ``accelerator.state`` is one."""

    def __init__(self, cpu: bool = False, backend: str | None = None, timeout: timedelta | None = None,
                 init_method: str | None = None, *, accelerator: SettledAccelerator | None = None) -> None:
        """``accelerator``: the Accelerator building this state (it passes itself); later ``AcceleratorState()``
        calls read its settings. Every live Accelerator is remembered (weakly; the newest answers), so a short-lived
        one that a helper builds and drops leaves the settings of the ones still alive readable, as Accelerate's
        shared state does."""
        super().__init__(cpu, backend, timeout, init_method)
        if accelerator is not None:
            refs = [r for r in self.__dict__.get("accelerator_refs", []) if r() is not None]
            self.__dict__["accelerator_refs"] = [*refs, weakref.ref(accelerator)]

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Accelerate's ``AcceleratorState._reset_state``: forget the Accelerators whose settings this state reads
        (and with ``reset_partial_state`` the process state too, see :meth:`PartialState._reset_state`)."""
        ProcessState._shared.pop("accelerator_refs", None)
        if reset_partial_state:
            PartialState._reset_state()

    def _accelerator(self, what: str) -> SettledAccelerator:
        for ref in reversed(self.__dict__.get("accelerator_refs", [])):
            accelerator = ref()
            if accelerator is not None:
                return accelerator
        raise RuntimeError(f"AcceleratorState().{what} is settled by the Accelerator; create Accelerator(...) "
                           "before reading it (and keep it alive while the state is read)")

    @property
    def distributed_type(self) -> DistributedType:
        return self._accelerator("distributed_type").distributed_type

    @property
    def mixed_precision(self) -> str:
        return self._accelerator("mixed_precision").mixed_precision

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        return self._accelerator("deepspeed_plugin").deepspeed_plugin

    @property
    def deepspeed_plugins(self) -> dict[str, DeepSpeedPlugin] | DeepSpeedPlugin | None:
        """Accelerate's: ``{name: plugin}`` when the plugins were given as ``deepspeed_plugins={name: plugin, ...}``,
        else the plugin in effect; None without DeepSpeed."""
        accelerator = self._accelerator("deepspeed_plugins")
        named = accelerator.record.deepspeed_named
        return {name: plugin for name, plugin, _ in named} if named else accelerator.deepspeed_plugin

    def get_deepspeed_plugin(self, name: str) -> DeepSpeedPlugin:
        """The DeepSpeed plugin given as ``deepspeed_plugins={name: plugin, ...}``."""
        return self._named_deepspeed_plugin(name, "get_deepspeed_plugin")

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Make ``name`` the active DeepSpeed plugin, as Accelerate's: ``prepare`` builds the next engines with its
        settled JSON (stage, clipping, checkpointing), ``init_context()`` and transformers' ZeRO-3 detection follow
        it; the engines already built keep theirs."""
        self._named_deepspeed_plugin(name, "select_deepspeed_plugin").select(_from_accelerator_state=True)

    def _named_deepspeed_plugin(self, name: str | None, what: str) -> DeepSpeedPlugin:
        plugins = self.deepspeed_plugins
        if plugins is None:  # set under DeepSpeed only
            raise ValueError(f"AcceleratorState().{what}({name!r}): DeepSpeed is not enabled; build the Accelerator "
                             "with deepspeed_plugins={name: DeepSpeedPlugin(...)} (or launch with --use_deepspeed)")
        if not isinstance(plugins, dict):
            raise KeyError(f"AcceleratorState().{what}({name!r}): the DeepSpeed plugin was given without a name; "
                           "pass it as deepspeed_plugins={name: plugin} to look it up by name, or read "
                           "AcceleratorState().deepspeed_plugin")
        if name not in plugins:
            raise KeyError(f"AcceleratorState().{what}({name!r}): no DeepSpeed plugin of that name; the Accelerator "
                           f"has {', '.join(map(repr, plugins))}")
        return plugins[name]

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin | None:
        return self._accelerator("fsdp_plugin").fsdp_plugin

    @property
    def dynamo_plugin(self) -> TorchDynamoPlugin:
        """The resolved ``TorchDynamoPlugin`` (backend ``no`` when nothing is compiled)."""
        return self._accelerator("dynamo_plugin").record.dynamo_plugin

    @property
    def is_fsdp2(self) -> bool:
        return bool(self._accelerator("is_fsdp2").is_fsdp2)

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The settled ``ParallelismConfig`` (None without one)."""
        return self._accelerator("parallelism_config").parallelism_config

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ``DeviceMesh`` built from it (``accelerator.torch_device_mesh``)."""
        return self._accelerator("device_mesh").torch_device_mesh
