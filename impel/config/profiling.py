"""``accelerator.profile()``: ``torch.profiler`` set up from a ``ProfileKwargs`` handler (Accelerate's names).

Example::

    acc = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir="trace")])
    with acc.profile() as prof:
        train_step()
    acc.print(prof.key_averages().table())      # trace/profile_<rank>.json written on every rank
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from impel.config.kwargs_handler import KwargsHandler
from impel.config.run_config import ConfigError

if TYPE_CHECKING:
    import torch.profiler

ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")
SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first", "skip_first_wait")
TRACE_NAME = "profile_{rank}.json"  # Accelerate's PROFILE_PATTERN_NAME


@dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments of ``torch.profiler.profile``; ``schedule_option`` builds ``torch.profiler.schedule``;
    ``output_trace_dir`` receives one Chrome trace per rank when the ``profile()`` block ends."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[[torch.profiler.profile], object] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        for activity in self.activities or ():
            if activity not in ACTIVITIES:
                raise ConfigError(f"ProfileKwargs(activities=[..., {activity!r}]) is not a profiler activity; use "
                                  f"some of {', '.join(map(repr, ACTIVITIES))}")
        unknown = sorted(set(self.schedule_option or {}) - set(SCHEDULE_KEYS))
        if unknown:
            raise ConfigError(f"ProfileKwargs(schedule_option=...) has unknown keys {unknown}; use "
                              f"{', '.join(SCHEDULE_KEYS)}")

    def build(self) -> torch.profiler.profile:
        """The ``torch.profiler.profile`` object these settings describe."""
        import torch.profiler as profiler

        activities = None
        if self.activities is not None:
            activities = []
            for name in self.activities:
                activity = getattr(profiler.ProfilerActivity, name.upper(), None)
                if activity is None:
                    raise ConfigError(f"ProfileKwargs(activities=[{name!r}]): this torch build has no "
                                      f"{name.upper()} profiler; drop {name!r}")
                activities.append(activity)
        schedule = profiler.schedule(**self.schedule_option) if self.schedule_option is not None else None
        return profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                                record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                with_stack=self.with_stack, with_flops=self.with_flops, with_modules=self.with_modules)


@contextlib.contextmanager
def profile_block(handler: ProfileKwargs, rank: int,
                  wait_for_everyone: Callable[[], None]) -> Iterator[torch.profiler.profile]:
    """Run the block under ``handler``'s profiler; then write this rank's Chrome trace and wait for every rank."""
    with handler.build() as prof:
        yield prof
    if handler.output_trace_dir is None:
        return
    os.makedirs(handler.output_trace_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(handler.output_trace_dir, TRACE_NAME.format(rank=rank)))
    wait_for_everyone()
