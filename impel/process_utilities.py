"""The Accelerator's collectives and process-control methods (Accelerate's names), split out of the facade.

A mixin over ``self.state`` (the :class:`impel.state.ProcessState`) and ``self.gradient_state``; the Accelerator
is the only class that uses it.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import collectives
from .config import ConfigError

if TYPE_CHECKING:
    from .accumulation import GradientState
    from .state import ProcessState


class ProcessUtilities:
    """gather / reduce / broadcast, wait_for_everyone, main_process_first, on_*_process, print, splitting."""

    state: ProcessState
    gradient_state: GradientState
    is_main_process: bool
    is_local_main_process: bool
    is_last_process: bool
    process_index: int
    num_processes: int

    # --- collectives ------------------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather across ranks and drop the samples ``even_batches`` duplicated in the last batch."""
        as_objects = use_gather_object
        if not as_objects:
            try:
                data = collectives.gather(input_data)
            except TypeError:
                as_objects = True
        if as_objects:
            data = collectives.gather_object(input_data)
        remainder = self.gradient_state.remainder
        if remainder < 0:
            return data
        return data[:remainder] if as_objects else collectives.truncate(data, remainder)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    def broadcast(self, data: Any, from_process: int = 0) -> Any:
        return collectives.broadcast(data, from_process)

    def broadcast_object_list(self, object_list: list[Any], from_process: int = 0) -> list[Any]:
        return collectives.broadcast_object_list(object_list, from_process)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    # --- process control --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only(function, lambda: self.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise ConfigError("on_process needs process_index=N")
        return self._only(function, lambda: self.process_index == process_index)

    @staticmethod
    def _only(function: Callable[..., Any], predicate: Callable[[], bool]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if predicate() else None

        return wrapper

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this rank's contiguous share of a list, tuple, dict of sequences or tensor."""
        from .splitting import split_for_rank

        yield split_for_rank(inputs, self.num_processes, self.process_index, apply_padding)
