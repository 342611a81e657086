"""Crash-safe runs: automatic resume, preemption (SIGTERM) and non-finite losses.

* ``auto_resume`` (``--auto_resume`` or ``ProjectConfiguration(automatic_resume=True)``): when the first prepared
  dataloader starts iterating, every rank loads the newest complete checkpoint (if there is one) and says so. Under
  ``impel launch --max_restarts N`` a crashed job restarts and continues from there.
* It also turns on preemption handling: SIGTERM sets a flag; at the next step boundary (a prepared dataloader about
  to draw the first batch of an accumulation group) the ranks agree (an all-reduce of the flag), save a
  checkpoint and exit with :data:`PREEMPTED_EXIT_CODE`. Relaunching the same command continues exactly.
* ``nonfinite_loss``: ``"error"`` stops at the first optimizer step whose loss was NaN/inf on any rank, naming the
  step; ``"skip"`` skips that step on every rank (the scheduler does not advance either); ``"ignore"`` (default)
  checks nothing and costs nothing.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from impel.config.run_config import ConfigError
from impel.runtime.ranks import rank_health

if TYPE_CHECKING:  # torch is imported lazily: `impel launch` imports this module for its exit code
    from types import FrameType

    import torch

    from impel.accelerator.prepared import TrainingRun
    from impel.accelerator.save_load import Checkpointer
    from impel.config.plugins import ProjectConfiguration
    from impel.config.run_config import RunConfig
    from impel.runtime.loaders.prepared_loader import PreparedLoader
    from impel.runtime.step.optimizer import AcceleratedOptimizer

logger = logging.getLogger("impel")
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "temporary failure, try again"


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is set on any rank (one tiny all-reduce when distributed)."""
    import torch
    import torch.distributed as dist

    from impel.runtime.ranks.collectives import is_distributed

    if not is_distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if rank_health.watching:  # it waits for every rank: the stall watchdog names who does not come
        with rank_health.blocking("the preemption check"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _same_plan_on_every_machine(low: int, high: int, asked: int, steps: int) -> None:
    """Every machine of an elastic job was launched with the same ``--nnodes`` and accumulation; machines that
    disagree would each train with their own gradient accumulation (6 on one, 9 on another) and never say so."""
    import torch.distributed as dist

    from impel.runtime.ranks.collectives import is_distributed

    if not is_distributed():
        return
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, (low, high, asked, steps))
    other = next((rank for rank, plan in enumerate(plans) if plan != plans[0]), None)
    if other is not None:
        shown = [f"rank {r} --nnodes {p[0]}:{p[1]} --gradient_accumulation_steps {p[2]} (accumulating {p[3]})"
                 for r, p in ((0, plans[0]), (other, plans[other]))]
        raise ConfigError(f"the machines of this elastic job were launched with different settings: {shown[0]}, "
                          f"{shown[1]}; launch every machine with the same --nnodes and --gradient_accumulation_steps")


class Resilience:
    """The Accelerator's crash-safety switches over one training run and its checkpointer; created only when one
    of them is on."""

    def __init__(self, run: TrainingRun, checkpointer: Checkpointer, auto_resume: bool, nonfinite: str,
                 elastic: tuple[int, int] | None = None) -> None:
        self.run = run
        self.elastic = elastic  # (planned world, accumulation asked for it) of an elastic job, else None
        self.checkpointer = checkpointer
        self.resume_pending = auto_resume
        self.handle_preemption = auto_resume
        self.nonfinite = nonfinite
        self.preempt_requested = False
        self.resumed_from: str | None = None
        self._bad_loss: torch.Tensor | None = None
        self._previous_handler: Any = None
        if self.handle_preemption:
            self._install_handler()

    @classmethod
    def create(cls, config: RunConfig, project: ProjectConfiguration, run: TrainingRun,
               checkpointer: Checkpointer) -> Resilience | None:
        auto = bool(config.auto_resume or project.automatic_resume)
        nonfinite = config.nonfinite_loss
        if config.min_machines is not None and not auto:
            raise ConfigError(f"an elastic job (impel launch --nnodes {config.min_machines}:{config.num_machines}) "
                              "continues from the last checkpoint when a machine is lost: turn on auto_resume "
                              "(impel launch --auto_resume, or ProjectConfiguration(automatic_resume=True)) and "
                              "call save_state() as training goes")
        if not auto and nonfinite == "ignore":
            return None
        if auto and not (project.project_dir and project.automatic_checkpoint_naming):
            raise ConfigError("auto_resume needs somewhere to find checkpoints: pass Accelerator(project_config="
                              "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))")
        elastic = None
        if config.min_machines is not None:
            from impel.accelerator.resolve import planned_world

            planned = planned_world(config, run.process.topology)
            elastic = (planned, config.gradient_accumulation_steps * run.num_processes // planned)
            _same_plan_on_every_machine(config.min_machines, config.num_machines, elastic[1],
                                        config.gradient_accumulation_steps)
        return cls(run, checkpointer, auto, nonfinite, elastic)

    # --- preemption -------------------------------------------------------------------------------------------
    def _install_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("auto_resume: the Accelerator was created outside the main thread, so SIGTERM cannot be "
                           "caught; preemption will not save a checkpoint")
            return
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if not self.preempt_requested:
            print(f"impel: SIGTERM on rank {self.run.process_index}: saving a checkpoint at the next step boundary",
                  flush=True)
        self.preempt_requested = True

    def uninstall(self) -> None:
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # --- dataloader hooks -------------------------------------------------------------------------------------
    def on_iter_start(self, loader: PreparedLoader) -> None:
        self.resume_now()

    def resume_now(self) -> str | None:
        """Do the pending auto-resume now (``Accelerator.resume_from_auto_checkpoint``); the checkpoint path,
        or None when there was nothing to resume from (or it already happened)."""
        if not self.resume_pending:
            return None
        self.resume_pending = False
        return self._resume()

    def before_batch(self, loader: PreparedLoader) -> None:
        if not self.handle_preemption or not self.run.gradient_state.sync_gradients:
            return  # mid-group: the boundary is after the group's optimizer step
        if _any_rank(self.preempt_requested, self.run.device):
            path = self.checkpointer.save(async_save=False)  # the process exits right after
            if self.run.is_main_process:
                again = "an elastic job's agent restarts it when machines join (after a preemption, relaunch the " \
                    "same command)" if self.elastic else "relaunch the same command to continue"
                print(f"impel: preempted; saved {path}; exiting with code {PREEMPTED_EXIT_CODE} ({again})", flush=True)
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def _resume(self) -> str | None:
        from impel.checkpoint.store import layout, remote
        from impel.runtime.ranks.collectives import broadcast_object_list

        run = self.run
        url = remote.parse(self.checkpointer.config.project_dir, "project_dir")
        root: Any = self.checkpointer.checkpoints_root() if url is None else url.child(layout.CHECKPOINTS_DIR)
        listed = (lambda: layout.list_complete(root)) if url is None else (lambda: remote.list_complete(root))
        found = broadcast_object_list([bool(listed()) if run.is_main_process else None])
        if not found[0]:
            if run.is_main_process:
                change = self._elastic_change(None)
                print(f"impel: auto_resume: no complete checkpoint under {root} yet; starting fresh"
                      + (f" ({change})" if change else ""), flush=True)
            return None
        self.resumed_from = self.checkpointer.load()
        if run.is_main_process:
            steps = sum(run.prepared.optimizer_steps())
            change = self._elastic_change(self.resumed_from)
            what = f"elastic restart: {change}; resumed" if change else "auto_resume: resumed"
            print(f"impel: {what} from {self.resumed_from} (optimizer steps taken: {steps})", flush=True)
        return self.resumed_from

    def _elastic_change(self, checkpoint: str | None) -> str | None:
        """An elastic job on another world size than ``checkpoint``'s (or, starting fresh, than planned): what
        changed, as one phrase (world size a -> b, gradient accumulation c -> d, the global batch kept)."""
        if self.elastic is None:
            return None
        from pathlib import Path

        from impel.checkpoint.store.layout import read_metadata

        world, steps = self.run.num_processes, self.run.gradient_state.num_steps
        before_world, before_steps = self.elastic
        if checkpoint is not None:
            saved = read_metadata(Path(checkpoint))
            before_world = int(saved.get("world_size") or world)
            before_steps = int(saved.get("gradient_accumulation_steps") or steps * world // before_world)
        if before_world == world:
            return None
        loaders = self.run.prepared.dataloaders
        total = getattr(loaders[0], "total_batch_size", None) if loaders else None
        micro = total // world if isinstance(total, int) else 0
        kept = f" (global batch {micro * steps * world} = {micro} per process x {steps} x {world} kept)" if micro \
            else " (the global batch kept)"
        return f"world size {before_world} -> {world}, gradient accumulation {before_steps} -> {steps}{kept}"

    # --- non-finite losses ------------------------------------------------------------------------------------
    def observe(self, loss: torch.Tensor) -> None:
        if self.nonfinite == "ignore":
            return
        import torch

        bad = ~torch.isfinite(loss.detach()).all()
        self._bad_loss = bad if self._bad_loss is None else (self._bad_loss | bad)

    def allow_step(self, optimizer: AcceleratedOptimizer) -> bool:
        """Called before a real optimizer step: False skips it on every rank (``nonfinite_loss='skip'``)."""
        if self.nonfinite == "ignore":
            return True
        local = bool(self._bad_loss.item()) if self._bad_loss is not None else False
        self._bad_loss = None
        if not _any_rank(local, self.run.device):
            return True
        step = optimizer.steps_taken + 1
        where = f"rank {self.run.process_index}" if local else "another rank"
        if self.nonfinite == "error":
            raise FloatingPointError(f"non-finite loss (NaN or inf) before optimizer step {step}, seen on {where}; "
                                     "lower the learning rate, check the data, or set nonfinite_loss='skip'")
        logger.warning("non-finite loss before optimizer step %d (seen on %s): step skipped on every rank", step, where)
        return False
