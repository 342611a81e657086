"""Accelerate's small general helpers (``accelerate.utils.other`` / ``.environment`` / ``.launch``): plain Python,
nothing about training. Environment access goes through :mod:`impel.config.environment`."""
from __future__ import annotations

import functools
import logging
import platform
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from impel.config import environment as env

logger = logging.getLogger(__name__)
# convert_dict_to_env_variables warns on the logger of the path it is imported from (impel.utils.environment, as
# Accelerate's accelerate.utils.environment), so a filter set up for that path sees it
_environment_logger = logging.getLogger("impel.utils.environment")
T = TypeVar("T")


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit that keeps it >= 1 (``"1.5 KB"``, as Accelerate prints it)."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def merge_dicts(source: dict[str, Any], destination: dict[str, Any]) -> dict[str, Any]:
    """Merge ``source`` into ``destination`` recursively (nested dicts merged, other values replaced); returns it."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def get_pretty_name(obj: object) -> str:
    """The ``__qualname__`` / ``__name__`` of ``obj`` (or of its class), else ``str(obj)``."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


def recursive_getattr(obj: object, attr: str) -> Any:
    """``obj.a.b.c`` for ``attr="a.b.c"``."""
    return functools.reduce(getattr, attr.split("."), obj)


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``localhost:port`` (default 29500, torchrun's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", 29500 if port is None else port)) == 0


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The names among ``library_names`` that are already imported."""
    return [name for name in library_names if name in sys.modules]


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """``KEY=value\\n`` lines for an env file, skipping (with a warning) entries that are empty or hold ``; \\n < >``
    or spaces."""
    lines = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in (";", "\n", "<", ">", " ")):
            lines.append(f"{key}={value}\n")
        else:
            _environment_logger.warning("Skipping %s=%s: it is empty or holds forbidden characters", key, value)
    return lines


def check_os_kernel() -> None:
    """Warn on a Linux kernel older than 5.5, where processes can hang (Accelerate's check)."""
    info = platform.uname()
    if info.system != "Linux":
        return
    numbers = [int(p) for p in info.release.split("-")[0].split(".")[:2] if p.isdigit()]
    if len(numbers) == 2 and tuple(numbers) < (5, 5):
        # the version in the message itself (not a %s argument), as Accelerate's record.msg shows it
        logger.warning(f"Detected kernel version {info.release}, below the recommended minimum 5.5.0; processes may "
                       "hang. Upgrade the kernel to the minimum version or higher.")


def purge_accelerate_environment(func_or_cls: T) -> T:
    """Decorate a function, or a test class's ``test*`` methods (its subclasses' too), so that the ``ACCELERATE_*``
    variables are after each call what they were before it (TrainingArguments(fp16=True) sets one, for example)."""
    def wrap(func: Callable[..., object]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: object, **kwargs: object) -> Any:
            with env.restored_prefix("ACCELERATE_"):
                return func(*args, **kwargs)
        wrapper._accelerate_is_purged_environment_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)  # type: ignore[arg-type, return-value]

    def wrap_tests(cls: type) -> type:
        for name in dir(cls):
            method = getattr(cls, name)
            if name.startswith("test") and callable(method) \
                    and not hasattr(method, "_accelerate_is_purged_environment_wrapped"):
                setattr(cls, name, wrap(method))
        return cls

    wrap_tests(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kw: wrap_tests(cls))  # type: ignore[assignment]
    return func_or_cls
