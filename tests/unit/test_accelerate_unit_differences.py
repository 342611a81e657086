"""Accelerate's unit-file differences of issue 39, decided for Accelerate's behaviour and checked against the installed
Accelerate: ``prepare`` hands back what it does not know and marks what it prepared (``_is_accelerate_prepared``),
``find_executable_batch_size(starting_batch_size=0)`` raises when called, a tracker that writes files needs a logging
directory (ValueError at construction), and ``free_memory`` drops every reference impel held to the prepared objects."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("accelerate.tracking")
import accelerate  # noqa: E402
import accelerate.tracking  # noqa: E402, F401 (module.tracking below)

import impel  # noqa: E402
import impel.tracking  # noqa: E402, F401


@pytest.fixture
def both():
    yield impel.Accelerator(cpu=True), accelerate.Accelerator(cpu=True)
    accelerate.state.AcceleratorState._reset_state(True)


def test_prepare_hands_back_what_it_does_not_know(both):
    class Tokenizer:
        pass

    for acc in both:
        things = [[1, 2], Tokenizer(), "text"]
        assert all(got is given for got, given in zip(acc.prepare(*things), things))
        model = torch.nn.Linear(2, 2)
        listed, prepared = acc.prepare(things[0], model)
        assert listed is things[0] and isinstance(prepared, torch.nn.Module)


def test_what_prepare_prepared_carries_accelerates_mark(both):
    """``_is_accelerate_prepared`` on every prepared model, optimizer, scheduler and loader, as Accelerate sets it
    (its own checks and libraries read it); not on what prepare hands back untouched."""
    marks = []
    for acc in both:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        prepared = acc.prepare(model, optimizer, scheduler, DataLoader(list(range(4)), batch_size=2), [1, 2])
        marks.append([getattr(obj, "_is_accelerate_prepared", False) for obj in prepared])
    assert marks[0] == marks[1] == [True, True, True, True, False]


def test_starting_batch_size_zero_raises_when_called_as_accelerate():
    for decorator in (impel.find_executable_batch_size, accelerate.utils.find_executable_batch_size):
        @decorator(starting_batch_size=0)
        def loop(batch_size):
            raise AssertionError("never called with batch size 0")

        with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
            loop()


def test_a_tracker_that_writes_files_needs_a_logging_dir_as_accelerate(tmp_path):
    pytest.importorskip("tensorboard")
    for module in (impel, accelerate):
        with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir` to be passed in"):
            module.Accelerator(cpu=True, log_with="tensorboard")
        acc = module.Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path / module.__name__))
        acc.init_trackers("run")
        acc.end_training()
    accelerate.state.AcceleratorState._reset_state(True)


@pytest.mark.parametrize("module", [impel, accelerate], ids=["impel", "accelerate"])
def test_a_registered_tracker_that_needs_a_logging_dir_raises_without_one(module, tmp_path):
    class Files(module.tracking.GeneralTracker):
        name = "dropin_files"
        requires_logging_directory = True

        def __init__(self, run_name, logging_dir):
            super().__init__()
            self.logging_dir = logging_dir

        @property
        def tracker(self):
            return None

    module.tracking.register_tracker_class(Files)
    try:
        with pytest.raises(ValueError, match="Logging with `dropin_files` requires a `logging_dir`"):
            module.Accelerator(cpu=True, log_with="dropin_files")
        acc = module.Accelerator(cpu=True, log_with="dropin_files", project_dir=str(tmp_path))
        acc.init_trackers("run")
        assert acc.get_tracker("dropin_files", unwrap=False).logging_dir == str(tmp_path)
    finally:
        module.tracking.LOGGER_TYPE_TO_CLASS.pop("dropin_files", None)
        accelerate.state.AcceleratorState._reset_state(True)


def test_free_memory_drops_every_reference_to_the_prepared_objects():
    """Accelerate's test reads its private ``_models`` / ``_optimizers`` lists; what it guards is this: after
    ``free_memory(*objects)`` nothing the Accelerator holds keeps a prepared object (or its weights) alive."""
    acc = impel.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    prepared = list(acc.prepare(model, optimizer, scheduler, DataLoader(list(range(8)), batch_size=2)))
    acc.backward(prepared[0](torch.ones(2, 4)).sum())
    prepared[1].step()
    prepared[2].step()
    refs = [weakref.ref(x) for x in (model, model.weight, optimizer, *prepared)]
    del model, optimizer, scheduler
    prepared = acc.free_memory(*prepared)
    assert prepared == [None] * 4
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
