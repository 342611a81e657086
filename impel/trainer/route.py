"""Any transformers ``Trainer`` subclass on impel's Accelerator: ``on_impel(SFTTrainer)``.

Libraries built on transformers (TRL's ``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer``, ``GRPOTrainer``, a team's
own subclass) inherit ``transformers.Trainer``, which builds Accelerate's Accelerator. ``on_impel(cls)`` returns a
subclass of ``cls`` with impel's :class:`impel.trainer.hf.Trainer` first in its method order: the library's code runs
unchanged, and the one method impel replaces (``create_accelerator_and_postprocess``) builds impel's Accelerator, so
the launch config (``impel launch --use_fsdp``, ...), impel's strategies and prepared loaders run the library's loop.
The class is built once per library class (cached), named as the original.

Example::

    from trl import SFTConfig, SFTTrainer
    from impel.trainer import on_impel

    trainer = on_impel(SFTTrainer)(model=model, args=SFTConfig(output_dir="out"), train_dataset=train)
    trainer.train()
"""
from __future__ import annotations

import functools

import transformers

from impel.trainer.hf import Trainer

__all__ = ["on_impel"]


@functools.cache
def on_impel(trainer_class: type[transformers.Trainer]) -> type[transformers.Trainer]:
    """``trainer_class`` (a ``transformers.Trainer`` subclass) running on impel's Accelerator: a subclass with
    :class:`impel.trainer.hf.Trainer` mixed in first (the same class for the same argument). impel's own Trainer, or a
    class already on impel, comes back unchanged."""
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, transformers.Trainer):
        raise TypeError(f"on_impel({trainer_class!r}): expected a transformers.Trainer subclass (e.g. trl.SFTTrainer); "
                        "for a custom loop use impel.Accelerator directly")
    if issubclass(trainer_class, Trainer):
        return trainer_class
    namespace = {"__module__": trainer_class.__module__, "__qualname__": trainer_class.__qualname__,
                 "__doc__": f"{trainer_class.__qualname__} on impel's Accelerator (impel.trainer.on_impel).\n\n"
                            f"{trainer_class.__doc__ or ''}"}
    return type(trainer_class.__name__, (Trainer, trainer_class), namespace)
