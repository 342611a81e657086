"""The best checkpoint, as transformers' Trainer keeps it: which evaluation is best, which checkpoint holds it,
rotation that never deletes it, and loading its weights at the end.

Rules (transformers' ``_determine_best_metric``, ``_save_checkpoint``, ``rotate_checkpoints``):

- after each evaluation in the loop, ``metrics["eval_" + metric_for_best_model]`` is compared with
  ``state.best_metric`` (strictly greater or smaller, by ``greater_is_better``); a new best records the metric and,
  when the run saves at all, ``state.best_global_step``;
- at each save, ``state.best_model_checkpoint`` becomes the checkpoint saved at ``best_global_step`` if one exists;
- rotation (``save_total_limit``) deletes the oldest checkpoints but keeps the newest and the best, so
  ``save_total_limit=1`` may keep two until training ends, when the non-best one goes.

impel names checkpoints ``checkpoints/checkpoint_<N>`` by save count, not by step, so ``state.checkpoints`` maps
each kept checkpoint's optimizer step to its directory.

Example::

    if update_best(args, state, metrics):
        print("new best", state.best_metric, "at step", state.best_global_step)
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from impel.checkpoint import layout, ownership
from impel.config.run_config import ConfigError

logger = logging.getLogger("impel")


def metric_key(args: Any) -> str:
    """The key of ``metric_for_best_model`` in evaluation metrics (``eval_`` added unless given)."""
    name = args.metric_for_best_model
    return name if name.startswith("eval_") else f"eval_{name}"


def update_best(args: Any, state: Any, metrics: dict[str, float]) -> bool:
    """Record ``metrics`` in ``state`` if they are the best so far; True when they are (transformers' rule)."""
    if args.metric_for_best_model is None:
        return False
    key = metric_key(args)
    if key not in metrics:
        raise ConfigError(f"metric_for_best_model={args.metric_for_best_model!r} looks for {key!r}, which is not in "
                          f"the evaluation metrics {sorted(metrics)}; use one of those names (with or without "
                          "'eval_')")
    value = float(metrics[key])
    best = state.best_metric
    if best is None:
        best = float("-inf") if args.greater_is_better else float("inf")
    if not (value > best if args.greater_is_better else value < best):
        return False
    state.best_metric = value
    if args.save_strategy != "no":
        state.best_global_step = state.global_step
    return True


def next_checkpoint_path(accelerator: Any) -> str:
    """Where the Accelerator's next automatically named ``save_state()`` goes (known before it writes, so the
    TrainerState saved inside the checkpoint already names it)."""
    root = Path(accelerator.project_dir).expanduser().absolute() / layout.CHECKPOINTS_DIR
    return str(root / layout.checkpoint_name(accelerator.save_iteration))


def note_save(state: Any, path: str) -> None:
    """Record a checkpoint about to be written at this step, and point ``best_model_checkpoint`` at the one saved
    at ``best_global_step`` if it exists (this one, or an earlier one still on disk)."""
    state.checkpoints[state.global_step] = path
    best = state.checkpoints.get(state.best_global_step) if state.best_global_step else None
    if best is not None and (best == path or os.path.isdir(best)):
        state.best_model_checkpoint = best


def rotate_checkpoints(state: Any, accelerator: Any, limit: int | None, save_on_each_node: bool) -> list[str]:
    """Delete the oldest complete checkpoints beyond ``limit``, never the newest nor the best. Returns the deleted
    directories (see :func:`_delete` for who decides and who deletes)."""
    if limit is None:
        return []

    def doomed(found: list[str]) -> list[str]:
        protected = {found[-1]} if found else set()
        if state.best_model_checkpoint is not None:
            protected.add(str(Path(state.best_model_checkpoint)))
        keep = max(limit, len(protected))
        return [path for path in found if path not in protected][:max(0, len(found) - keep)]

    return _delete(state, accelerator, save_on_each_node, doomed, f"save_total_limit={limit}")


def keep_only_best(state: Any, accelerator: Any, save_on_each_node: bool) -> None:
    """At the end of training with ``save_total_limit=1``: only the best checkpoint stays (transformers)."""
    best = state.best_model_checkpoint
    if best is not None:
        _delete(state, accelerator, save_on_each_node, lambda found: [p for p in found if p != str(Path(best))],
                "save_total_limit=1")


def _delete(state: Any, accelerator: Any, save_on_each_node: bool, choose: Any, why: str) -> list[str]:
    """The main process lists the complete checkpoints and ``choose``s what goes; every rank gets that list (one
    listing: a rank reading the directory while the main process deletes would see another set) and forgets those
    in ``state.checkpoints``; the processes that write checkpoints (the main one, or each node's first with
    ``save_on_each_node``) delete them."""
    root = Path(next_checkpoint_path(accelerator)).parent
    mine = choose([str(p) for _, p in layout.list_complete(root)]) if accelerator.is_main_process else None
    decided: list[Any] = [mine]  # broadcast from rank 0: every rank ends with its list
    if accelerator.use_distributed:
        from impel.runtime.collectives import broadcast_object_list

        broadcast_object_list(decided, from_process=0)
    doomed: list[str] = decided[0]
    leader = accelerator.is_main_process or (save_on_each_node and accelerator.is_local_main_process)
    for path in doomed:
        if leader:
            ownership.remove_checkpoint(Path(path), why)
        state.checkpoints = {s: p for s, p in state.checkpoints.items() if p != path}
    return doomed


def load_best_model(accelerator: Any, model: Any, directory: str) -> None:
    """Load only the model weights of the checkpoint ``directory`` into the prepared ``model`` (every rank; any
    strategy's format: full files, DCP shards or DeepSpeed's engine checkpoint). Files are verified first."""
    path = Path(directory)
    metadata = layout.verify(path)
    skipped = set(metadata.get("strategy", {}).get("skipped_models", []))
    if 0 in skipped:
        raise layout.CheckpointError(f"{path} was saved by a save_state pre-hook that took over the model; load the "
                                     "best model with that hook's own loader")
    accelerator.strategy.load_checkpoint([model], [], path, metadata["strategy"])
