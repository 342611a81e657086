"""A reference model that training changes, kept in the Trainer's checkpoints (TRL's ``sync_ref_model``).

TRL's DPO and GRPO trainers with ``sync_ref_model=True`` mix the policy into ``trainer.ref_model`` every
``ref_model_sync_steps`` optimizer steps (``SyncRefModelCallback``). transformers' checkpoint holds the policy only,
so a run resumed on Accelerate goes on from the reference model as it was loaded, not as it was synced (a DPO run on a
tiny GPT-2 ends 1.7e-2 away from the uninterrupted one). impel's Trainer writes it into the checkpoint as
``impel_ref_model.pt`` (its full state dict, gathered from every rank under FSDP2, written by the main process) and
loads it back on resume, so the resumed run ends on the uninterrupted run's weights. A checkpoint without the file
(written on Accelerate) resumes as on Accelerate, with a warning that says so.

Example::

    trainer = on_impel(DPOTrainer)(model=model, ref_model=ref, args=DPOConfig(..., sync_ref_model=True, save_steps=50))
    trainer.train(resume_from_checkpoint="out/checkpoint-50")   # the reference model as synced at step 50
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from impel.checkpoint.io.files import read_torch, write_torch
from impel.checkpoint.saving.session import SaveSession

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["FILE", "load", "save"]

logger = logging.getLogger("impel")

FILE = "impel_ref_model.pt"


def _synced_reference(trainer: Trainer) -> torch.nn.Module | None:
    """The trainer's reference model when training changes it (``args.sync_ref_model``), else None."""
    reference = getattr(trainer, "ref_model", None)
    if isinstance(reference, torch.nn.Module) and getattr(trainer.args, "sync_ref_model", False):
        return reference
    return None


def save(trainer: Trainer, folder: str) -> None:
    """Write the synced reference model into ``folder`` (a collective under FSDP2: every rank calls it)."""
    reference = _synced_reference(trainer)
    if reference is None:
        return
    several = trainer.accelerator.num_processes > 1
    state = get_model_state_dict(reference, options=StateDictOptions(full_state_dict=True, cpu_offload=several))
    if trainer.args.should_save:  # fsynced, loaded back safely (impel's checkpoint files)
        write_torch(SaveSession.plain(), state, Path(folder) / FILE)


def load(trainer: Trainer, folder: str) -> None:
    """Load the reference model ``save`` wrote into ``folder`` on every rank (warn when the checkpoint has none)."""
    reference = _synced_reference(trainer)
    if reference is None:
        return
    path = Path(folder) / FILE
    if not path.is_file():
        logger.warning("impel: %s has no %s (a checkpoint written on Accelerate): the reference model "
                       "(sync_ref_model=True) goes on as loaded, not as synced before the save, so the resumed run "
                       "differs from the uninterrupted one", folder, FILE)
        return
    state = read_torch(None, path, "the synced reference model (sync_ref_model=True)")
    set_model_state_dict(reference, state, options=StateDictOptions(full_state_dict=True))
