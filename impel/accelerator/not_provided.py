"""The Accelerator's members of Accelerate's surface that impel deliberately does not provide: fp8 training, LOMO
optimizers, DeepSpeed's engine wrapper and sequence parallelism. Reading one (or calling it) raises
:class:`impel.config.unsupported.NotProvidedError` naming it, the reason and what to use, instead of a bare
``AttributeError``; ``has_fp8_handler`` and ``has_lomo_optimizer`` answer False, which is true under impel.

Reading an attribute raises :class:`impel.config.unsupported.NotProvidedAttributeError` (a NotProvidedError and an
AttributeError, so ``hasattr`` answers False); a method reads as a function that raises when called.

Example::

    accelerator.fp8_backend      # NotProvidedError: impel does not provide Accelerator.fp8_backend: impel has no ...
    accelerator.lomo_backward(loss, 1e-3)  # NotProvidedError: impel does not provide Accelerator.lomo_backward: ...
"""
from __future__ import annotations

from typing import Any, NoReturn

from impel.config.unsupported import NotProvidedAttributeError, NotProvidedError

_FP8 = "impel has no fp8 mode (accelerator.fp8_enabled is False); train in bf16 (mixed_precision='bf16')"
_LOMO = "impel does not drive LOMO optimizers (their fused backward updates the weights); use a torch optimizer " \
        "with accelerator.backward(loss)"
_ENGINE = "impel's prepared model is the DeepSpeed engine and accelerator.backward(loss) / optimizer.step() drive it"


class NotProvidedMember:
    """A class attribute standing for one of Accelerate's members (the class shows the descriptor, so ``dir`` /
    ``hasattr(Accelerator, name)`` see Accelerate's name). A method (``method=True``) reads as a function that
    raises :class:`NotProvidedError` when called; an attribute raises :class:`NotProvidedAttributeError` (also an
    AttributeError: ``hasattr(accelerator, name)`` is False, ``inspect`` and mock autospec skip it) when read."""

    def __init__(self, reason: str, method: bool = False) -> None:
        self.reason = reason
        self.method = method
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        if self.method:
            return self._refusing_method()
        raise NotProvidedAttributeError(self.message())

    def _refusing_method(self) -> Any:
        def refused(*args: Any, **kwargs: Any) -> NoReturn:
            self.refuse()

        refused.__name__ = self.name
        refused.__qualname__ = f"Accelerator.{self.name}"
        refused.__doc__ = f"Not provided by impel: {self.reason}"
        return refused

    def message(self) -> str:
        return f"impel does not provide Accelerator.{self.name}: {self.reason}"

    def refuse(self) -> NoReturn:
        raise NotProvidedError(self.message())


class NotProvidedMembers:
    """Mixed into the Accelerator: Accelerate's fp8, LOMO and DeepSpeed-internal members, each raising on use."""

    fp8_backend = NotProvidedMember(_FP8)
    fp8_recipe_handler = NotProvidedMember(_FP8)
    ao_recipe_handler = NotProvidedMember(_FP8)
    te_recipe_handler = NotProvidedMember(_FP8)
    msamp_recipe_handler = NotProvidedMember(_FP8)
    delayed_fp8_autocast = NotProvidedMember(_FP8)
    lomo_backward = NotProvidedMember(_LOMO, method=True)
    deepspeed_engine_wrapped = NotProvidedMember(_ENGINE)
    deepspeed_config = NotProvidedMember("impel fills the DeepSpeed JSON for each engine at prepare: the one an engine "
                                    "was built with is the prepared model's .config (DeepSpeed's engine attribute)")
    deepspeed_ulysses_dl_adapter = NotProvidedMember("DeepSpeed sequence parallelism (Ulysses) is not supported "
                                                     "(ParallelismConfig(sp_size > 1) raises)", method=True)
    has_fp8_handler = False  # no fp8 recipe handler: impel has no fp8 mode
    has_lomo_optimizer = False  # no LOMO optimizer: impel does not drive them
