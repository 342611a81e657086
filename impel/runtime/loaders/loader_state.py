"""Accelerate's ``DataLoaderStateMixin``: the state a prepared loader shows while it is iterated.

``end_of_dataloader`` (the batch in use is the pass's last) and ``remainder`` (real samples of the last global batch,
-1 when unknown). impel's prepared loaders (:class:`impel.runtime.loaders.prepared_loader.PreparedLoader`, hence
``DataLoaderDispatcher``) keep them and are instances of this class, as Accelerate's are of its mixin. A class of
one's own that subclasses it gets the two attributes and ``reset()``; Accelerate's ``begin()`` / ``end()`` register
the loader in its GradientState's internals, which impel's prepared loaders do for themselves, so they raise here.

Example::

    isinstance(accelerator.prepare(DataLoader(ds, batch_size=8)), DataLoaderStateMixin)  # True
"""
from __future__ import annotations

from abc import ABC
from typing import NoReturn

from impel.runtime.loaders.prepared_loader import PreparedLoader


class DataLoaderStateMixin(ABC):  # noqa: B024  # no abstract method: a mixin, and the type of prepared loaders
    """``end_of_dataloader`` and ``remainder`` of a loader, as Accelerate's mixin of that name."""

    end_of_dataloader: bool = False
    remainder: int = -1

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.end_of_dataloader = False
        cls.remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> NoReturn:
        raise NotImplementedError("DataLoaderStateMixin.begin() registers a loader in Accelerate's GradientState "
                                  "internals; impel's prepared loaders track their pass themselves: prepare the "
                                  "DataLoader with accelerator.prepare (or impel.data_loader.prepare_data_loader)")

    def end(self) -> NoReturn:
        raise NotImplementedError("DataLoaderStateMixin.end(): see begin(); prepare the DataLoader with "
                                  "accelerator.prepare instead")


DataLoaderStateMixin.register(PreparedLoader)
