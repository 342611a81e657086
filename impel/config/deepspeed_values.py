"""The values of a DeepSpeed JSON that impel reads, checked for type and range where the JSON is read (issue 36):
DeepSpeed itself would fail on them later with a traceback, or not at all (``offload_optimizer: gpu9``).

Example::

    check_json_values({"gradient_clipping": "big"}, "ds.json")   # ConfigError: gradient_clipping='big' in ds.json ...
"""
from __future__ import annotations

from collections.abc import Mapping

from impel.config.schema import ConfigError

_WHOLE = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DEVICES = ("none", "cpu", "nvme")


def check_json_values(ds: Mapping[str, object], source: str) -> None:
    """Batch sizes are whole numbers >= 1, ``gradient_clipping`` a number >= 0, offload devices none/cpu/nvme (each
    may also be ``"auto"``)."""
    for key in _WHOLE:
        value = ds.get(key, "auto")
        if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"{key}={value!r} in {source} must be a whole number >= 1 or \"auto\"")
    clip = ds.get("gradient_clipping", "auto")
    if clip != "auto" and not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0):
        raise ConfigError(f"gradient_clipping={clip!r} in {source} must be a number >= 0 (the largest gradient norm; "
                          "0 turns clipping off) or \"auto\"")
    zero = ds.get("zero_optimization")
    for what in ("optimizer", "param"):
        section = zero.get(f"offload_{what}") if isinstance(zero, Mapping) else None
        device = section.get("device", "none") if isinstance(section, Mapping) else "none"
        if device not in ("auto", None, *_DEVICES):
            raise ConfigError(f"zero_optimization.offload_{what}.device={device!r} in {source} must be one of "
                              f"{', '.join(_DEVICES)} (or \"auto\")")
