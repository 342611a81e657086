"""Process control over the topology alone: ``main_process_first``, the ``on_*_process`` decorators, ``print``,
``split_between_processes`` (Accelerate's names).

A mixin for :class:`~impel.runtime.ranks.process.PartialState` and (through
:class:`~impel.accelerator.process_methods.ProcessMethods`)
the Accelerator: it needs only the topology properties and ``wait_for_everyone`` of the class it is mixed into.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from impel.config.run_config import ConfigError

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class ProcessControl:
    """main_process_first, on_*_process decorators, print, split_between_processes."""

    if TYPE_CHECKING:  # what the class this is mixed into provides (read-only properties in both users)
        @property
        def is_main_process(self) -> bool: ...
        @property
        def is_local_main_process(self) -> bool: ...
        @property
        def is_last_process(self) -> bool: ...
        @property
        def process_index(self) -> int: ...
        @property
        def local_process_index(self) -> int: ...
        @property
        def num_processes(self) -> int: ...
        def wait_for_everyone(self) -> None: ...

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

    def on_main_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        return self._only(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        return self._only(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        return self._only(function, lambda: self.is_last_process)

    @overload
    def on_process(self, function: Callable[P, R], process_index: int | None = None) -> Callable[P, R | None]: ...
    @overload
    def on_process(self, function: None = None,
                   process_index: int | None = None) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...
    def on_process(self, function: Callable[P, R] | None = None,
                   process_index: int | None = None) -> Callable[..., object]:
        """Run the decorated function only on the process with this index (``@on_process(process_index=N)``)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise ConfigError("on_process needs process_index=N")
        return self._only(function, lambda: self.process_index == process_index)

    @overload
    def on_local_process(self, function: Callable[P, R],
                         local_process_index: int | None = None) -> Callable[P, R | None]: ...
    @overload
    def on_local_process(self, function: None = None, local_process_index: int | None = None
                         ) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...
    def on_local_process(self, function: Callable[P, R] | None = None,
                         local_process_index: int | None = None) -> Callable[..., object]:
        """Run the decorated function only on the process with this local (per-machine) index."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        if local_process_index is None:
            raise ConfigError("on_local_process needs local_process_index=N")
        return self._only(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only(function: Callable[P, R], predicate: Callable[[], bool]) -> Callable[P, R | None]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return function(*args, **kwargs) if predicate() else None

        return wrapper

    def print(self, *args: object, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: T, apply_padding: bool = False) -> Iterator[T]:
        """Yield this rank's contiguous share of a list, tuple, dict of sequences or tensor."""
        from impel.runtime.ranks.splitting import split_for_rank

        yield split_for_rank(inputs, self.num_processes, self.process_index, apply_padding)
