"""The ``dynamo_config`` section (torch.compile through the Accelerator) and Accelerate's ``DynamoBackend`` enum.

Keys and flags are Accelerate's: ``dynamo_config: {dynamo_backend: INDUCTOR, dynamo_mode: default,
dynamo_use_fullgraph: false, dynamo_use_dynamic: false, dynamo_use_regional_compilation: false}`` in a config file,
``--dynamo_backend inductor --dynamo_use_regional_compilation`` on ``impel launch``. :mod:`impel.config.run_config`
holds it as
``RunConfig.dynamo_config``; :mod:`impel.runtime.step.compile` does the compiling. Like ``impel.config.run_config`` this
module never imports
torch, and it imports nothing from impel but :mod:`impel.config.schema` (``impel.config.run_config`` imports it while it
is being built).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from impel.config.schema import Freezable, option, validate_fields


class _ValuesContained(enum.EnumMeta):
    """``"INDUCTOR" in DynamoBackend`` is True, as with Accelerate's enums (plain Python 3.11 enums raise)."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class DynamoBackend(str, enum.Enum, metaclass=_ValuesContained):
    """Accelerate's torch.compile backends (values upper case; torch's backend is the lower-case name).

    EAGER, AOT_EAGER and INDUCTOR run wherever torch does (INDUCTOR needs a C++ compiler on CPU, triton on CUDA);
    CUDAGRAPHS needs CUDA; the others need their package (``impel.runtime.step.compile`` says which) or, for
    AOT_TS_NVFUSER,
    NVPRIMS_NVFUSER and OFI, no longer exist in torch. One that cannot run raises when the Accelerator is built.
    """

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


BACKENDS = tuple(DynamoBackend.list())
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's modes


@dataclass
class DynamoConfig(Freezable):
    """The ``dynamo_config`` section. YAML keys and flags carry a ``dynamo_`` prefix (``dynamo_backend``)."""

    PREFIX = "dynamo_"

    # YAML 1.1 reads an unquoted NO as false; a lower-case name (inductor) is matched to its member
    backend: str = option("NO", "str", "torch.compile backend for prepared models (NO: do not compile)",
                          choices=BACKENDS, aliases={False: "NO"})
    mode: str = option("default", "str", "torch.compile mode (inductor)", choices=MODES)
    use_fullgraph: bool = option(False, "bool", "compile each model as one graph (a graph break is an error)")
    use_dynamic: bool | None = option(None, "bool", "trace with dynamic shapes (empty: torch decides)")
    use_regional_compilation: bool = option(False, "bool", "compile each repeated block (transformer layers) "
                                            "instead of the whole model: a shorter cold start")

    def validate(self) -> DynamoConfig:
        validate_fields(self)
        return self

    @property
    def enabled(self) -> bool:
        return self.backend != "NO"
