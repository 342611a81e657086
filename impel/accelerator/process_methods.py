"""The Accelerator's collectives and process-control methods (Accelerate's names), split out of the facade.

:class:`~impel.runtime.ranks.process_control.ProcessControl` needs only the topology properties and
``wait_for_everyone`` (``PartialState`` uses it too); :class:`ProcessMethods` adds what works over ``self.state`` and
``self.gradient_state`` (the Accelerator's): collectives, triggers, ``save``, ``profile``, ``join_uneven_inputs``.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, TypeVar

from impel.config.run_config import ConfigError
from impel.runtime.ranks import collectives
from impel.runtime.ranks.process_control import ProcessControl

if TYPE_CHECKING:
    import torch
    from torch.distributed.algorithms.join import Joinable
    from torch.distributed.device_mesh import DeviceMesh

    from impel.accelerator.prepared import Prepared
    from impel.config.parallelism import ParallelismConfig
    from impel.config.plugins import DataLoaderConfiguration, Handlers, ProjectConfiguration
    from impel.config.profiling import ProfileKwargs
    from impel.config.run_config import DistributedType
    from impel.runtime.ranks.process import ProcessState
    from impel.runtime.step.accumulation import GradientState
    from impel.strategies.base import Strategy


T = TypeVar("T")


class ProcessMethods(ProcessControl):
    """The Accelerator's gather / reduce / broadcast, wait_for_everyone, triggers, save, profile and join."""

    state: ProcessState
    gradient_state: GradientState
    device: torch.device
    distributed_type: DistributedType
    strategy: Strategy
    handlers: Handlers
    project_configuration: ProjectConfiguration
    dataloader_config: DataLoaderConfiguration
    prepared: Prepared
    flag_tensor: torch.Tensor | None = None  # set_trigger's flag (a 0-d tensor once set)
    parallelism_config: ParallelismConfig | None  # RunSettings' properties: the settled ParallelismConfig and its mesh
    torch_device_mesh: DeviceMesh | None

    # --- collectives ------------------------------------------------------------------------------------------
    def gather(self, tensor: T) -> T:
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather across the data-parallel ranks (one copy per batch: the TP / CP ranks of one data-parallel rank
        hold the same samples, which Accelerate 1.15 gathers again) and drop the samples ``even_batches``
        duplicated in the last batch."""
        group = self._data_parallel_group()
        as_objects = use_gather_object
        if not as_objects:
            try:
                data = collectives.gather(input_data, group)
            except TypeError:
                as_objects = True
        if as_objects:
            data = collectives.gather_object(input_data, group)
        remainder = self.gradient_state.remainder
        if remainder < 0:
            return data
        return data[:remainder] if as_objects else collectives.truncate(data, remainder)

    def _data_parallel_group(self) -> Any:
        """The ranks that read different batches: every rank (None) without tensor / context parallelism, else the
        mesh's ``dp`` group (:data:`collectives.SELF` when there is one data-parallel rank)."""
        pc = self.parallelism_config
        if pc is None or pc.non_data_parallel_size == 1:
            return None
        if pc.data_parallel_size == 1:
            return collectives.SELF
        return pc.submesh("dp").get_group()

    def reduce(self, tensor: T, reduction: str = "sum", scale: float = 1.0) -> T:
        return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: T, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> T:
        return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    def broadcast(self, data: T, from_process: int = 0) -> T:
        return collectives.broadcast(data, from_process)

    def broadcast_object_list(self, object_list: list[T], from_process: int = 0) -> list[T]:
        return collectives.broadcast_object_list(object_list, from_process)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    # --- triggers (early stopping agreed by every rank) ---------------------------------------------------------
    def set_trigger(self) -> None:
        """Raise this rank's flag; the next :meth:`check_trigger` returns True on every rank."""
        import torch

        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Collective (call it on every rank): True everywhere if any rank called :meth:`set_trigger` since the last
        check that fired, which clears the flag."""
        import torch

        flag = getattr(self, "flag_tensor", None)
        if flag is None:
            flag = torch.tensor(0, device=self.device)
        total = collectives.reduce(flag, "sum")
        if int(total.item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        self.flag_tensor = flag
        return False

    # --- saving, profiling, uneven inputs -----------------------------------------------------------------------
    def save(self, obj: object, f: str | os.PathLike[str] | IO[bytes], safe_serialization: bool = False) -> None:
        """``torch.save`` (``safe_serialization=True``: safetensors, for a dict of tensors) on the main process only,
        or on each machine's local main process with ``ProjectConfiguration(save_on_each_node=True)``. Not
        collective and no barrier, as in Accelerate."""
        from impel.checkpoint.saving.save_object import save

        save(obj, f, save_on_each_node=self.project_configuration.save_on_each_node,
             safe_serialization=safe_serialization)

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler`` (settings: this handler, else the ``ProfileKwargs`` in
        ``kwargs_handlers``, else defaults); yields the profiler. With ``output_trace_dir`` every rank writes
        ``profile_<rank>.json`` there, then all ranks wait for each other."""
        from impel.config.profiling import ProfileKwargs, profile_block

        handler = profile_handler or self.handlers.profile or ProfileKwargs()
        with profile_block(handler, self.process_index, self.wait_for_everyone) as prof:
            yield prof

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Joinable], even_batches: bool | None = None) -> Iterator[None]:
        """Train or evaluate on ranks with different numbers of batches: torch's ``Join`` over ``joinables`` (the
        prepared DDP models) lets ranks that ran out shadow the others' gradient all-reduces.

        ``even_batches`` overrides the prepared dataloaders' setting inside the block (``False`` gives ranks
        uneven batch counts; ``Join`` is enabled only then). One process: nothing to join. FSDP and DeepSpeed have
        no ``Join`` support in torch, so they raise.
        """
        if not self.state.use_distributed:
            yield
            return
        if not self.strategy.uses_ddp:
            raise ConfigError(f"join_uneven_inputs works with DDP (MULTI_CPU / MULTI_GPU), not distributed_type="
                              f"{str(self.distributed_type)!r}: torch has no Join for it; keep even_batches=True so "
                              "every rank runs the same number of batches")
        from torch.distributed.algorithms.join import Join, Joinable

        for item in joinables:
            if not isinstance(item, Joinable):
                raise ConfigError(f"join_uneven_inputs got a {type(item).__name__}, which is not a torch Joinable; "
                                  "pass the models returned by accelerator.prepare (DDP-wrapped)")
        shards = [dl.shard for dl in self.prepared.dataloaders]
        before = [shard.even_batches for shard in shards]
        if even_batches is not None:
            for shard in shards:
                shard.even_batches = bool(even_batches)
        uneven = not (self.dataloader_config.even_batches if even_batches is None else even_batches)
        for shard in shards:
            shard.joined = True
        try:
            with Join(list(joinables), enable=uneven, throw_on_early_termination=False):
                yield
        finally:
            for shard, value in zip(shards, before):
                shard.even_batches = value
                shard.joined = False
