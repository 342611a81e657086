"""A custom ``GeneralTracker`` (an instance in ``log_with``, and a class registered by name) receives what
Accelerate 1.15 hands it for the same script, on 1 process and 2 CPU ranks: config, ``init_kwargs`` (the registered
class), ``log_kwargs``, steps, in the same order, on the main process only. With ``main_process_only = False`` impel
runs the tracker on every process, as GeneralTracker's contract says; Accelerate's Accelerator still calls it on the
main process only (its ``init_trackers`` and ``log`` are main-process-only methods): a documented difference.
"""
from __future__ import annotations

import os

import pytest

from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess
pytest.importorskip("accelerate")


def _script(framework: str, main_process_only: bool, root: str) -> dict:
    if framework == "accelerate":
        from accelerate import Accelerator
        from accelerate.tracking import GeneralTracker, register_tracker_class
    else:
        from impel import Accelerator
        from impel.trackers.registry import GeneralTracker, register_tracker_class

    class Recorder(GeneralTracker):
        name = "recorder"
        requires_logging_directory = False

        def __init__(self, *args, **kwargs) -> None:
            super().__init__()
            self.calls = [["built", list(args), kwargs]] if args or kwargs else []

        @property
        def tracker(self) -> list:
            return self.calls

        def start(self) -> None:
            self.calls.append(["start"])

        def store_init_configuration(self, values: dict) -> None:
            self.calls.append(["config", values])

        def log(self, values: dict, step: int | None = None, **kwargs) -> None:
            self.calls.append(["log", values, step, kwargs])

        def finish(self) -> None:
            self.calls.append(["finish"])

    class Registered(Recorder):
        name = "registered"
        requires_logging_directory = True

        def __init__(self, run_name: str, logging_dir: str, **kwargs) -> None:
            super().__init__(run_name, os.path.relpath(logging_dir, root), **kwargs)

    register_tracker_class(Registered)
    recorder = Recorder()
    recorder.main_process_only = main_process_only
    acc = Accelerator(cpu=True, log_with=[recorder, "registered"], project_dir=os.path.join(root, "project"))
    acc.init_trackers("proj", config={"lr": 0.1, "name": "tiny"},
                      init_kwargs={"registered": {"flavour": "x"}, "recorder": {"unused": True}})
    acc.log({"loss": 0.5}, step=1, log_kwargs={"recorder": {"commit": False}, "registered": {"k": 1}})
    acc.log({"loss": 0.25})
    registered = acc.get_tracker("registered")
    active = [t.name for t in acc.trackers]
    acc.end_training()
    return {"recorder": recorder.calls, "registered": getattr(registered, "calls", None), "active": active}


MAIN = [["start"], ["config", {"lr": 0.1, "name": "tiny"}], ["log", {"loss": 0.5}, 1, {"commit": False}],
        ["log", {"loss": 0.25}, None, {}], ["finish"]]
REGISTERED = [["built", ["proj", "project"], {"flavour": "x"}], ["start"], ["config", {"lr": 0.1, "name": "tiny"}],
              ["log", {"loss": 0.5}, 1, {"k": 1}], ["log", {"loss": 0.25}, None, {}], ["finish"]]


@pytest.mark.parametrize(("world", "main_process_only"), [(1, True), (2, True), (2, False)])
def test_custom_trackers_receive_what_accelerate_gives_them(tmp_path, world, main_process_only):
    ours = run_on_ranks(_script, world, args=("impel", main_process_only, str(tmp_path)))
    theirs = run_on_ranks(_script, world, args=("accelerate", main_process_only, str(tmp_path)),
                          env={"ACCELERATE_USE_CPU": "1"})
    assert ours[0] == theirs[0] == {"recorder": MAIN, "registered": REGISTERED, "active": ["recorder", "registered"]}
    if world == 2:
        # the registered class is main-process-only: the other rank gets a blank stand-in from get_tracker
        assert theirs[1] == {"recorder": [], "registered": None, "active": []}
        if main_process_only:
            assert ours[1] == theirs[1]
        else:
            assert ours[1] == {"recorder": MAIN, "registered": None, "active": ["recorder"]}
