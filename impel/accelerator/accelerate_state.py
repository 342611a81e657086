"""Accelerate's own state, mirroring impel's run, for libraries that call Accelerate's helpers themselves.

TRL and PEFT import Accelerate and keep calling its module-level helpers (``accelerate.utils.set_seed(...,
device_specific=True)``, ``gather_object``, ``broadcast_object_list``, ``accelerate.logging.get_logger``,
``AcceleratorState().deepspeed_plugin``), which read Accelerate's process-wide ``PartialState`` /
``AcceleratorState``: on impel's Accelerator those were never created, and the helpers stop with Accelerate's
"initialize your accelerator via ``accelerator = Accelerator()``". So when impel builds its Accelerator in a process
that has imported Accelerate, :func:`mirror` creates Accelerate's state with Accelerate's own constructors (its
``PartialState`` joins impel's process group, no second one) and checks it against impel's run (rank, world size,
local rank, device: a difference raises), then sets what Accelerate cannot know (impel's ``distributed_type``, mixed
precision, the FSDP / DeepSpeed plugin in effect). It logs one line naming it. A process that never imports
Accelerate is untouched (nothing is imported). Accelerate's ``GradientState`` is not mirrored (Accelerate's
helpers the libraries call do not read it; impel's Accelerator keeps its own).

Never two states silently: if Accelerate's own ``Accelerator`` already initialised that state in this process, it is
left alone and a warning names both. A later impel Accelerator re-mirrors (the state it mirrored before is reset).

Example::

    import accelerate.utils, impel
    acc = impel.Accelerator()                 # "impel: Accelerate's AcceleratorState mirrors this run (...)"
    accelerate.utils.set_seed(0, device_specific=True)   # 0 + rank, as under Accelerate
"""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from impel.config.run_config import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("impel")

MARK = "impel_mirrors_this_run"  # set in Accelerate's shared state: the mirror is impel's, a later one may replace it


def mirror(accelerator: Any) -> None:
    """Create Accelerate's ``PartialState`` / ``AcceleratorState`` to match ``accelerator`` (impel's), when this
    process has imported Accelerate; see the module docstring."""
    if "accelerate" not in sys.modules:
        return  # nothing here imports Accelerate, so nothing reads its state
    from accelerate.state import AcceleratorState, PartialState

    shared = AcceleratorState._shared_state
    if shared and shared != PartialState._shared_state and not shared.get(MARK):
        logger.warning("impel: accelerate.Accelerator was also built in this process; Accelerate's helpers "
                       "(accelerate.utils.set_seed, gather_object, ...) read its state (%s, %s), impel's "
                       "Accelerator runs %s, %s: build one of them", shared.get("distributed_type"),
                       shared.get("_mixed_precision"), accelerator.distributed_type, accelerator.mixed_precision)
        return
    if shared.get(MARK):
        AcceleratorState._reset_state()  # an earlier impel Accelerator's mirror: this one's settings replace it
    cpu = accelerator.device.type == "cpu"
    _check_process(PartialState(cpu=cpu), accelerator)
    from accelerate.utils import TorchDynamoPlugin

    # backend "no" here: Accelerate's constructor would configure torch for its own compiled runs (impel did for its)
    state = AcceleratorState(mixed_precision=accelerator.mixed_precision, cpu=cpu, _from_accelerator=True,
                             dynamo_plugin=TorchDynamoPlugin(backend="no"))
    _set_strategy(state, accelerator)
    AcceleratorState._shared_state[MARK] = True
    logger.info("impel: Accelerate's AcceleratorState mirrors this run (process %d of %d, %s, %s, mixed precision "
                "%s) for libraries that call Accelerate's helpers (TRL, PEFT); training runs on impel's Accelerator",
                accelerator.process_index, accelerator.num_processes, accelerator.device,
                accelerator.distributed_type, accelerator.mixed_precision)


def _check_process(partial: Any, accelerator: Any) -> None:
    theirs = (partial.process_index, partial.num_processes, partial.local_process_index, _device(partial.device))
    ours = (accelerator.process_index, accelerator.num_processes, accelerator.local_process_index,
            _device(accelerator.device))
    if theirs != ours:
        raise ConfigError(f"Accelerate's PartialState in this process sees process {theirs[0]} of {theirs[1]} "
                          f"(local {theirs[2]}, {theirs[3]}), impel's Accelerator runs process {ours[0]} of "
                          f"{ours[1]} (local {ours[2]}, {ours[3]}): libraries calling Accelerate's helpers would "
                          "disagree with impel. On a machine without GPUs set ACCELERATE_USE_CPU=1 (impel launch "
                          "sets it) or TrainingArguments(use_cpu=True) before Accelerate's state is first created")


def _device(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else str(device)  # Accelerate names the CPU "cpu:0" on several ranks


def _set_strategy(state: Any, accelerator: Any) -> None:
    """What Accelerate's constructor cannot know from the environment: impel's strategy and its plugin."""
    from accelerate.state import DistributedType, PartialState

    kind = DistributedType(str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)))
    state.distributed_type = kind
    state.dynamo_plugin = accelerator.state.dynamo_plugin
    PartialState._shared_state["distributed_type"] = kind  # as Accelerate's constructor leaves it
    state.fsdp_plugin = accelerator.fsdp_plugin  # None unless the run shards with FSDP2
    state.deepspeed_plugins = getattr(accelerator.state, "deepspeed_plugins", None)  # None unless DeepSpeed
