"""Accelerate's multi-process logger: ``logger.info(msg)`` logs on the main process only, ``main_process_only=False``
on every rank, ``in_order=True`` on every rank one after the other.

Example::

    logger = get_logger(__name__, log_level="INFO")
    accelerator = Accelerator()
    logger.info("starting")                              # rank 0 only
    logger.info("my shard", main_process_only=False)     # every rank, prefixed "[RANK r]"
"""
from __future__ import annotations

import functools
import logging
from collections.abc import MutableMapping
from typing import Any


def _state() -> Any:
    from impel.runtime.ranks.process import PartialState, ProcessState

    if not ProcessState._shared.get("initialized"):
        raise RuntimeError("the multi-process logger needs the process state: create the Accelerator (or "
                           "PartialState()) before logging, as with Accelerate")
    return PartialState()


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``logging.LoggerAdapter`` whose calls take ``main_process_only`` (default True) and ``in_order``."""

    def process(self, msg: object, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)  # report the caller's line, not this adapter's
        return f"[RANK {_state().process_index}] {msg}", kwargs

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        """Log on the main process (``main_process_only=True``, the default), on every process (False), or on
        every process in rank order (``in_order=True``, which waits for each rank: call it on all of them)."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        state = _state()
        if not self.isEnabledFor(level):
            return
        msg, log_kwargs = self.process(msg, kwargs)
        if not in_order:
            if not main_process_only or state.is_main_process:
                self.logger.log(level, msg, *args, **log_kwargs)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **log_kwargs)
            state.wait_for_everyone()

    @functools.lru_cache(None)  # noqa: B019 - one warning per distinct message for the process's lifetime
    def warning_once(self, *args: object, **kwargs: Any) -> None:
        """``warning()``, emitted once per distinct arguments."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger ``name`` wrapped for several processes; ``log_level`` (default: ``$ACCELERATE_LOG_LEVEL`` when
    set) is applied to it and to the root logger, as Accelerate does."""
    from impel.config.environment import accelerate_log_level

    level = log_level if log_level is not None else accelerate_log_level()
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
