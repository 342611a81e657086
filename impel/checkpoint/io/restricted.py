"""Reading the pickles in Accelerate's checkpoints without running their code.

Accelerate stores its RNG states (``random_states_<rank>.pkl``: python's state tuple, numpy's state with an
ndarray, torch ByteTensors) and registered objects' states with ``torch.save``, and reads them back with
``weights_only=False``: whatever globals a file names are imported and called. impel reads them with
:class:`RestrictedUnpickler`, whose ``find_class`` hands out only the globals in :data:`ALLOWED` (torch's tensor
rebuilders, numpy's array and dtype rebuilders, a few builtins): a file naming anything else (``os.system``, a
user class) fails with a :class:`RefusedGlobal` that names the global, and nothing of it runs. torch's own
machinery still reads the zip container and the tensor storages (``torch.load(pickle_module=...)``).

``sampler.bin`` holds a pickled sampler *object* (Accelerate's ``SeedableRandomSampler`` with its dataset and
generator). :func:`load_inert` reads such a file into :class:`Inert` stand-ins instead: every global outside the
allowlist becomes a record of its name, arguments and state, never the real class, so impel can read the fields it
needs (the epoch) without building the objects.
"""
from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

_NUMPY_DTYPES = {f"{kind}{bits}DType" for kind in ("Int", "UInt") for bits in (8, 16, 32, 64)} | {
    "Float16DType", "Float32DType", "Float64DType", "LongDoubleDType", "Complex64DType", "Complex128DType",
    "BoolDType", "ByteDType", "UByteDType", "ShortDType", "UShortDType", "IntDType", "UIntDType", "LongDType",
    "ULongDType", "LongLongDType", "ULongLongDType", "HalfDType", "DoubleDType", "CLongDoubleDType"}

#: module -> names a restricted unpickle may import: data rebuilders only, nothing that calls back into user code
ALLOWED: dict[str, frozenset[str]] = {
    "torch._utils": frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter",
                               "_rebuild_parameter_with_state"}),
    "torch": frozenset({"Size", "device"}),  # + every torch dtype (torch.float32, ...), see _allowed
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "complex", "bytearray", "slice", "range"}),
    "_codecs": frozenset({"encode"}),  # protocol 2 stores numpy's raw bytes as encode(str, 'latin1')
    "numpy": frozenset({"ndarray", "dtype"}),
    "numpy.core.multiarray": frozenset({"_reconstruct", "scalar"}),  # numpy 1.x
    "numpy._core.multiarray": frozenset({"_reconstruct", "scalar"}),  # numpy 2.x
    "numpy.dtypes": frozenset(_NUMPY_DTYPES),
}


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside the allowlist; ``.name`` is ``module.qualname``."""

    def __init__(self, module: str, name: str) -> None:
        self.name = f"{module}.{name}"
        super().__init__(f"the pickle asks for {self.name}, which impel does not unpickle")


def _allowed(module: str, name: str) -> bool:
    if name in ALLOWED.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that imports only the globals in :data:`ALLOWED` and raises :class:`RefusedGlobal` otherwise."""

    def find_class(self, module: str, name: str) -> object:
        if _allowed(module, name):
            return super().find_class(module, name)
        raise RefusedGlobal(module, name)


class Inert:
    """A stand-in for an object of a class outside the allowlist: what the pickle said about it, nothing run.

    ``global_name``: the class or function the pickle named; ``args``: the arguments it would have been called
    with; ``state``: what it would have been given to ``__setstate__`` (usually its ``__dict__``).
    """

    global_name = "?"
    args: tuple[object, ...]
    state: object

    def __new__(cls, *args: object, **kwargs: object) -> Inert:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        self.state = state

    def field(self, key: str, default: object = None) -> object:
        """``key`` of the recorded ``__dict__`` state (the second item when the state is ``(dict, slots)``)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            merged = dict(state[1] or {})
            merged.update(state[0] or {})
            state = merged
        return state.get(key, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"<inert {self.global_name}>"


class InertUnpickler(RestrictedUnpickler):
    """Allowed globals are real; every other global becomes an :class:`Inert` subclass named after it."""

    _stand_ins: dict[str, type[Inert]] = {}

    def find_class(self, module: str, name: str) -> object:
        if _allowed(module, name):
            return pickle.Unpickler.find_class(self, module, name)
        key = f"{module}.{name}"
        if key not in self._stand_ins:
            self._stand_ins[key] = type(f"Inert[{key}]", (Inert,), {"global_name": key})
        return self._stand_ins[key]


def _pickle_module(unpickler: type[pickle.Unpickler]) -> types.ModuleType:
    """What ``torch.load(pickle_module=...)`` needs: ``Unpickler`` (subclassed by torch for storages) and ``load``."""
    module = types.ModuleType(f"impel_{unpickler.__name__}")
    vars(module).update(Unpickler=unpickler, load=lambda f, **kw: unpickler(f, **kw).load())
    return module


def load_restricted(path: Path, inert: bool = False) -> Any:
    """``torch.load`` of ``path`` on CPU through :class:`RestrictedUnpickler` (or :class:`InertUnpickler`).

    Raises :class:`RefusedGlobal` for a global outside the allowlist (never with ``inert``), the reader's own
    errors (``RuntimeError``, ``EOFError``, ...) for a damaged file.
    """
    module = _pickle_module(InertUnpickler if inert else RestrictedUnpickler)
    # weights_only=False only hands the unpickling to `module`, whose find_class is the allowlist above; torch
    # refuses a pickle_module under TORCH_FORCE_WEIGHTS_ONLY_LOAD, where its own safe loader with numpy's
    # rebuilders allowed does the same job (without inert stand-ins).
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=module)
    except RuntimeError as exc:
        if "explicit pickle_module" not in str(exc) or inert:
            raise
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def _numpy_globals() -> list[Any]:
    import numpy as np

    found: list[Any] = [np.ndarray, np.dtype]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            found.append(__import__(module, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    found += [getattr(np.dtypes, n) for n in sorted(_NUMPY_DTYPES) if hasattr(getattr(np, "dtypes", None), n)]
    return found
