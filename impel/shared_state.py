"""Accelerate's state objects over impel's :class:`~impel.state.ProcessState` (reach them as ``impel.state.X``).

All share one process-wide record, as Accelerate's do: ``PartialState()`` is the process (rank, device, process
group) with its process-control helpers and needs no Accelerator; ``AcceleratorState()`` adds what the live
Accelerator resolved (``distributed_type``, ``mixed_precision``, ``deepspeed_plugin``, ``fsdp_plugin``,
``dynamo_plugin``).

Example::

    state = PartialState()
    with state.split_between_processes(prompts) as mine:
        outputs = [generate(p) for p in mine]
"""
from __future__ import annotations

import weakref
from typing import Any

from . import env
from .accumulation import GradientState
from .config import DistributedType
from .process_utilities import ProcessControl
from .state import ProcessState

__all__ = ["AcceleratorState", "GradientState", "PartialState", "current_topology"]


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
    def default_device(self) -> Any:
        return self.device


class AcceleratorState(PartialState):
    """``PartialState`` plus the settings the live Accelerator resolved; ``accelerator.state`` is one."""

    def attach(self, accelerator: Any, dynamo_plugin: Any) -> None:
        """Called by the Accelerator: later ``AcceleratorState()`` calls read its settings."""
        self.__dict__["accelerator_ref"] = weakref.ref(accelerator)
        self.__dict__["dynamo_plugin_ref"] = dynamo_plugin

    def _accelerator(self, what: str) -> Any:
        ref = self.__dict__.get("accelerator_ref")
        accelerator = ref() if ref is not None else None
        if accelerator is None:
            raise RuntimeError(f"AcceleratorState().{what} is settled by the Accelerator; create Accelerator(...) "
                               "before reading it")
        return accelerator

    @property
    def distributed_type(self) -> DistributedType:
        return self._accelerator("distributed_type").distributed_type

    @property
    def mixed_precision(self) -> str:
        return self._accelerator("mixed_precision").mixed_precision

    @property
    def deepspeed_plugin(self) -> Any:
        return self._accelerator("deepspeed_plugin").deepspeed_plugin

    @property
    def fsdp_plugin(self) -> Any:
        return self._accelerator("fsdp_plugin").fsdp_plugin

    @property
    def dynamo_plugin(self) -> Any:
        """The resolved ``TorchDynamoPlugin`` (backend ``no`` when nothing is compiled)."""
        self._accelerator("dynamo_plugin")  # raises before any Accelerator exists
        return self.__dict__["dynamo_plugin_ref"]

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP
