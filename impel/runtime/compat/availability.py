"""Accelerate's ``is_*_available`` checks: is an optional package importable, is a kind of device usable here.

Package checks look for the package without importing it. Device checks answer for this machine; impel itself
drives CPUs and CUDA GPUs (MPS for one process), so a True for another kind of device says the hardware is there,
not that impel will use it.

Example::

    if is_wandb_available():
        accelerator = Accelerator(log_with="wandb")
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
        return False


def is_rich_available() -> bool:
    return _installed("rich")


def is_tqdm_available() -> bool:
    return _installed("tqdm")


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml")


def is_aim_available() -> bool:
    return _installed("aim")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_swanlab_available() -> bool:
    return _installed("swanlab")


def is_trackio_available() -> bool:
    return _installed("trackio")


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_peft_available() -> bool:
    return _installed("peft")


def is_timm_available() -> bool:
    return _installed("timm")


def is_torchvision_available() -> bool:
    return _installed("torchvision")


def is_pandas_available() -> bool:
    return _installed("pandas")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")


def is_bnb_available(min_version: str | None = None) -> bool:
    if min_version is None or not _installed("bitsandbytes"):
        return _installed("bitsandbytes")
    return compare_versions("bitsandbytes", ">=", min_version)


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_torchdata_stateful_dataloader_available() -> bool:
    return _installed("torchdata") and _installed("torchdata.stateful_dataloader")


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla importable (``check_is_tpu`` / ``check_is_gpu``: and its device is a TPU / GPU)."""
    if not _installed("torch_xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime as xr  # noqa: PLC0415 - only when asked about the device

    kind = xr.device_type()
    return (check_is_tpu and kind == "TPU") or (check_is_gpu and kind in ("GPU", "CUDA"))


# --- devices ------------------------------------------------------------------------------------------------
def is_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def is_mps_available(min_version: str | None = None) -> bool:
    import torch

    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available():
        return False
    if min_version is None:
        return True
    major, _, minor = min_version.partition(".")
    return bool(mps.is_macos_or_newer(int(major), int(minor or 0)))


def _torch_device(kind: str, package: str | None) -> bool:
    """``torch.<kind>.is_available()`` after importing its out-of-tree ``package`` (which registers it)."""
    if package is not None:
        if not _installed(package):
            return False
        importlib.import_module(package)
    import torch

    backend: Any = getattr(torch, kind, None)
    return bool(backend is not None and backend.is_available())


def is_xpu_available(check_device: bool = False) -> bool:
    return _torch_device("xpu", None)


def is_npu_available(check_device: bool = False) -> bool:
    return _torch_device("npu", "torch_npu")


def is_mlu_available(check_device: bool = False) -> bool:
    return _torch_device("mlu", "torch_mlu")


def is_musa_available(check_device: bool = False) -> bool:
    return _torch_device("musa", "torch_musa")


def is_sdaa_available(check_device: bool = False) -> bool:
    return _torch_device("sdaa", "torch_sdaa")


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Habana Gaudi usable (``init_hccl``: also load its collective backend, as Accelerate does)."""
    if not _installed("habana_frameworks") or not _torch_device("hpu", "habana_frameworks.torch"):
        return False
    if init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return True


def is_neuron_available(check_device: bool = False) -> bool:
    return _torch_device("neuron", "torch_neuronx")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 compute works here: on CUDA when the GPU supports it, on MPS from macOS 14, always on CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_fp16_available() -> bool:
    return True


def is_fp8_available() -> bool:
    """False: impel has no fp8 mode (``mixed_precision='fp8'`` raises), whatever fp8 libraries are installed."""
    return False


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch with ``version``: ``is_torch_version(">=", "2.4")``."""
    import torch

    return compare_versions(torch.__version__, operation, version)


def compare_versions(library_or_version: str, operation: str, requirement_version: str) -> bool:
    """``compare_versions("torch", ">=", "2.4")`` or with a version string as the first argument."""
    import operator

    parse: Callable[[str], Any]
    try:
        from packaging.version import parse as packaging_parse

        parse = packaging_parse
    except ImportError:  # torch's own comparable version string
        from torch.torch_version import TorchVersion

        parse = TorchVersion

    ops = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
           "<": operator.lt}
    if operation not in ops:
        raise ValueError(f"operation={operation!r} is not a comparison; use one of {', '.join(ops)}")
    version = library_or_version
    if not any(ch.isdigit() for ch in library_or_version[:1]):
        from importlib.metadata import version as installed_version

        version = installed_version(library_or_version)
    return ops[operation](parse(version), parse(requirement_version))


# --- packages impel does not use itself: the answer is only whether they are installed -------------------------
def is_pytest_available() -> bool:
    return _installed("pytest")


def is_torchdata_available() -> bool:
    return _installed("torchdata")


def is_triton_available() -> bool:
    return _installed("triton")


def is_boto3_available() -> bool:
    return _installed("boto3")


def is_pynvml_available() -> bool:
    return _installed("pynvml")


def is_amdsmi_available() -> bool:
    return _installed("amdsmi")


def is_lomo_available() -> bool:
    return _installed("lomo_optim")


def is_import_timer_available() -> bool:
    return _installed("import_timer")


def is_pippy_available() -> bool:
    """Whether torch ships pipelining (impel does not drive PiPPy inference)."""
    return _installed("torch.distributed.pipelining")


def is_transformer_engine_available() -> bool:
    return _installed("transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    return False  # needs Transformer Engine on Blackwell GPUs, and impel has no fp8 mode anyway


def is_msamp_available() -> bool:
    return _installed("msamp")


def is_torchao_available() -> bool:
    return _installed("torchao")


def is_megatron_lm_available() -> bool:
    return _installed("megatron")


def is_sagemaker_available() -> bool:
    return _installed("sagemaker")


def is_4bit_bnb_available() -> bool:
    return is_bnb_available()


def is_8bit_bnb_available() -> bool:
    return is_bnb_available()


def is_bitsandbytes_multi_backend_available() -> bool:
    return False  # bitsandbytes' multi-backend preview; impel drives CUDA only


def is_weights_only_available() -> bool:
    """``torch.load(weights_only=True)`` exists (torch >= 2.4, which impel requires)."""
    return True


def is_rocm_available() -> bool:
    """Whether torch was built for AMD ROCm."""
    import torch

    return torch.version.hip is not None


def is_xccl_available() -> bool:
    """Whether torch.distributed has Intel's XCCL backend."""
    import torch.distributed as dist

    return bool(dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)())


def is_habana_gaudi1() -> bool:
    return False  # a Gaudi generation check; impel does not drive HPUs
