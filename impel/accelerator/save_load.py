"""``save_state`` / ``load_state``: the steps every rank runs, in order. The Accelerator's methods forward here.

save: all ranks check in (a call on one rank raises) -> agree on the target -> the leader cleans leftovers and
picks a temporary directory -> pre-hooks -> the strategy writes models and optimizers -> the leader writes
schedulers, counters, dataloader positions, the GradScaler and registered objects -> each rank writes its RNG
state (each finished file is hashed and fsynced in the background meanwhile) -> the files nobody hashed yet (DCP,
DeepSpeed, hooks) are hashed by all ranks in parallel -> the leader seals (manifest from those digests, metadata,
marker, fsync) and renames -> rotation (``total_limit``). With ``async_save`` the writes up to the RNG state are
staged in CPU memory instead (``staging``) and everything from the writes on runs on a background thread, its
collectives on a dedicated gloo group; the next save/load, ``end_training`` and exit wait for it. Its call does no
collective: each rank checks the target and names the temporary directory itself, and the check-in and the
agreement on the target are the background thread's first step.

load: check in -> the leader finds the directory (newest complete one by default) and verifies sizes and
checksums -> pre-hooks -> GradScaler, models and optimizers (strategy), schedulers, counters, dataloaders,
registered objects, and last this rank's RNG state. A directory written by Accelerate's ``save_state`` (no marker,
Accelerate's file names) is read by ``accelerate_format`` instead, in the same order.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import platform
import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from impel.accelerator import load_accelerate as accelerate_format
from impel.checkpoint.formats.full import suffix
from impel.checkpoint.io import verified
from impel.checkpoint.io.digests import Entry, Sealer, share_digests
from impel.checkpoint.io.files import crc32_off, read_torch, write_torch
from impel.checkpoint.saving import collective, stager, staging
from impel.checkpoint.saving.options import DEFAULT_LOAD, DEFAULT_SAVE, LoadOptions, SaveOptions
from impel.checkpoint.saving.registered import write_registered
from impel.checkpoint.saving.session import SaveSession
from impel.checkpoint.saving.state import (
    check_registrable,
    collect_rng_state,
    collect_training_state,
    describe,
    restore_rng_state,
    restore_training_state,
)
from impel.checkpoint.store import layout, ownership, remote, storage, target, tempdirs
from impel.config.plugins import ProjectConfiguration
from impel.config.run_config import ConfigError
from impel.runtime.step.memory import trim_host_heap

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from impel.accelerator.prepared import TrainingRun

logger = logging.getLogger("impel")

TRAINING_STATE_FILE = "training_state.pt"


@dataclasses.dataclass(frozen=True)
class _WriteNow:
    """A synchronous save's writes, done by :meth:`Checkpointer._finish` while the files are sealed."""
    safe_serialization: bool
    options: SaveOptions


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


class Checkpointer:
    """Saves and loads one training run (:class:`impel.accelerator.prepared.TrainingRun`, handed over by the
    Accelerator) under
    its project configuration; holds the state hooks."""

    def __init__(self, config: ProjectConfiguration, run: TrainingRun, async_save: bool = False,
                 elastic: bool = False) -> None:
        self.config = config
        self.run = run
        self.async_configured = async_save  # the run config's async_save key
        self.pending: staging.PendingSave | None = None
        self._stager: stager.Stager | None = None  # created by the first asynchronous save
        self._needed = target.NeededBytes()
        self.save_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self.load_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self.elastic = elastic  # an elastic job: a load on another world size is expected (resilience reports it)
        self._uploads: dict[str, remote.Remote] = {}  # a save's local staging directory -> its object-storage URL
        self._downloaded: Path | None = None  # the leader's local copy of a loaded URL

    # --- registration -----------------------------------------------------------------------------------------
    def register(self, *objects: object) -> None:
        check_registrable(objects)
        self.run.prepared.registered.extend(objects)

    def add_hook(self, hooks: OrderedDict[int, Callable[..., None]], hook: Callable[..., None]) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"a state hook must be callable, got {describe(hook)}")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    # --- paths ------------------------------------------------------------------------------------------------
    def checkpoints_root(self) -> Path:
        if self.config.project_dir is None:
            raise ConfigError("automatic_checkpoint_naming=True needs a project directory; pass "
                              "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)")
        return target.local_path(self.config.project_dir, "project_dir") / layout.CHECKPOINTS_DIR

    def _save_target(self, output_dir: remote.Location) -> Path:
        """The local directory the save writes; for a URL, its local staging directory (uploaded at the commit)."""
        config = self.config
        if config.automatic_checkpoint_naming and output_dir is not None:
            logger.warning("save_state(output_dir=%r) is ignored: automatic_checkpoint_naming=True saves to "
                           "project_dir/checkpoints/checkpoint_N", output_dir)
        url = remote.save_target(output_dir, config.project_dir, config.automatic_checkpoint_naming,
                                 config.iteration, config.save_on_each_node)
        if url is not None:
            local = remote.staging_path(url)
            self._uploads[str(local)] = url
            return local
        if config.automatic_checkpoint_naming:
            return self.checkpoints_root() / layout.checkpoint_name(config.iteration)
        if output_dir is None:
            raise ConfigError("save_state() needs output_dir, or ProjectConfiguration(project_dir=..., "
                              "automatic_checkpoint_naming=True)")
        return target.local_path(output_dir, "save_state(output_dir)")

    def _leader(self) -> bool:
        run = self.run
        return run.is_main_process or (self.config.save_on_each_node and run.is_local_main_process)

    # --- save -------------------------------------------------------------------------------------------------
    def save(self, output_dir: remote.Location = None, safe_serialization: bool = True,
             options: SaveOptions = DEFAULT_SAVE, async_save: bool | None = None) -> str:
        """One sequence for both kinds of save: the blocking part here (check-in, target, hooks, and the state
        written, or with ``async_save`` staged in CPU memory), then :meth:`_finish` (files, digests, the leader's
        commit) now, or on a background thread (``staging``). ``async_save=None``: the configured default."""
        asynchronous = self.async_default() if async_save is None else bool(async_save)
        self.wait()  # a pending save first: its failure raises here, on every rank
        if not any(self.run.prepared.counts().values()):
            raise layout.CheckpointError(
                "save_state() before prepare(): no model, optimizer, scheduler or dataloader is prepared and no "
                "object is registered, so the checkpoint would hold random states only; call "
                "accelerator.prepare(model, optimizer, ...) (or register_for_checkpointing(obj)) first")
        options = dataclasses.replace(options, shared_dir=not self.config.save_on_each_node)
        if asynchronous:
            return self._save_async(output_dir, safe_serialization, options)
        collective.arrive("save_state", self.run.process.timeout)
        final = self._save_target(output_dir)
        shown = str(self._uploads.get(str(final), final))  # a URL: the local staging directory is uploaded there
        leader = self._leader()
        # one collective: the ranks agree on the target and get the temporary directory the leader prepared
        prepared = collective.prepare_agreed(str(final), "the save_state output directory",
                                             functools.partial(self._prepare, final, layout.temp_dir_for(final), True),
                                             "preparing the checkpoint directory", leader)
        assert prepared is not None  # rank 0 always leads, and every rank gets rank 0's result
        session = SaveSession(Path(prepared), final, leader=leader)
        # _finish removes the leader's temporary directory on failure
        self._finish(session, _WriteNow(safe_serialization, options))
        self.config.iteration += 1
        return shown

    def _save_async(self, output_dir: remote.Location, safe_serialization: bool, options: SaveOptions) -> str:
        """The call of an asynchronous save does no collective (but the first's, which checks in and creates the
        background group): each rank checks the target itself (a bad target raises here, alike on every rank), names
        the temporary directory as every other rank does (``staging.temp_token``) and stages. The check-in and the
        agreement on the target are the background job's first step (:meth:`_finish`), bounded by the timeout."""
        final = self._save_target(output_dir)
        shown = str(self._uploads.get(str(final), final))
        self._check_async()
        if not staging.group_ready():  # the first asynchronous save: its group's creation is collective
            collective.arrive("save_state", self.run.process.timeout)  # (a call on one rank raises, not hangs)
        group = staging.background_group(self.run.process.timeout)
        # the temporary directory is named before anything that can fail on one rank only
        session = SaveSession(layout.temp_dir_for(final, staging.temp_token()), final, leader=self._leader(),
                              group=group)
        try:  # the leader's cleaning spares temp, which the others may be filling already
            self._prepare(final, session.checkpoint_dir, clean=session.leader)
        except Exception as exc:
            # a bad target fails alike on every rank; should it pass on some, their job's first step fails too
            # (instead of waiting for this rank until the timeout): this rank's job takes part in that step only
            if group is not None:
                self.pending = staging.PendingSave(shown, functools.partial(self._settle, session, exc), reported=exc)
            raise
        previous = self.pending
        try:
            staged = self._stage(session, safe_serialization, options)
            self.pending = staging.PendingSave(shown, functools.partial(self._finish, session, staged, staged.error),
                                               reported=staged.error)
            if staged.error is not None:
                self.config.iteration += 1  # as on the other ranks, whose calls returned
                raise staged.error
        except BaseException:
            # the other ranks may still be staging into temp: then the leader removes it after _settle (_finish)
            if session.leader and (group is None or self.pending is previous):
                shutil.rmtree(session.checkpoint_dir, ignore_errors=True)
            raise
        self.config.iteration += 1
        return shown

    def _stage(self, session: SaveSession, safe_serialization: bool, options: SaveOptions) -> staging.Deferred:
        """The blocking part of an asynchronous save: the writes recorded with their state staged, and the metadata.
        No collective: a failure is kept in ``Deferred.error``; it raises at the call on this rank, and the
        background job's first step shares it, so the save fails on every rank (at their next call)."""
        if self._stager is None:
            self._stager = staging.new_stager()
        with session.staging(self._stager) as deferred:
            try:
                with storage.translated(session.final, session.checkpoint_dir, self._needed_bytes):
                    session.metadata = self._metadata(self._write(session, safe_serialization, options))
            except Exception as exc:  # noqa: BLE001 - raised by the caller, shared by the background job
                deferred.error = exc
        return deferred

    def _finish(self, session: SaveSession, writes: _WriteNow | staging.Deferred,
                staged: BaseException | None = None) -> None:
        """The part of a save that can run later, on every rank in the same order: the ``writes`` (done now, or
        an asynchronous save's recorded ones) while the files are hashed, the digests shared, then the leader's
        commit. Its collectives run on ``session.group`` (None: the default group, on the main thread).
        ``staged``: an asynchronous save's staging failure on this rank (every rank's are shared first, so all of
        them fail the save)."""
        try:
            if session.group is not None:
                self._settle(session, staged)
            elif staged is not None:  # one process: nothing to tell; the call raised it, nothing is committed
                raise staged
            with session.sealing() as sealer, crc32_off():
                # one all-gather: the write's failure on any rank, every rank's digests and parts
                gathered = collective.gather_shared(functools.partial(self._written, session, writes, sealer),
                                                    "save_state", session.group)
            merged = share_digests(session.checkpoint_dir, [entries for entries, _ in gathered],
                                   shared_dir=not self.config.save_on_each_node, group=session.group)
            parts = [rank_parts for _, rank_parts in gathered]
            collective.run_shared(functools.partial(self._committed, session, merged, parts),
                                  "committing the checkpoint", session.group)
        except BaseException:
            if session.leader:
                shutil.rmtree(session.checkpoint_dir, ignore_errors=True)
            raise
        trim_host_heap()  # the write's buffers, freed in its threads' arenas, go back to the OS

    def _written(self, session: SaveSession, writes: _WriteNow | staging.Deferred,
                 sealer: Sealer) -> tuple[dict[str, Entry], dict[str, Metadata]]:
        """The files written (the recorded writes replayed, or written now); every file's digests, hashed as written
        (after their fsyncs), and the parts of the files the committer writes (each DCP directory's metadata)."""
        with storage.translated(session.final, session.checkpoint_dir, self._needed_bytes):
            if isinstance(writes, staging.Deferred):
                writes.run()
            else:
                session.metadata = self._metadata(self._write(session, writes.safe_serialization, writes.options))
            return sealer.entries(), sealer.parts

    def _committed(self, session: SaveSession, merged: dict[str, Entry], parts: list[dict[str, Metadata]]) -> None:
        if session.leader:
            with storage.translated(session.final, session.checkpoint_dir, self._needed_bytes):
                self._commit(session.checkpoint_dir, session.final, session.metadata, merged, parts)

    def _settle(self, session: SaveSession, staged: BaseException | None) -> None:
        """An asynchronous save's first step on the background group, one all-gather: every rank joined (else the
        group's timeout, named), with the same target, and none failed at its call (``staged``: this rank's
        failure, raised here; the others' raised here as a CheckpointError naming them)."""
        collective.prepare_agreed(
            str(session.checkpoint_dir), "the save_state output directory (its temporary directory counts the job's "
            "asynchronous saves: a rank that called save_state more often than another names another)",
            functools.partial(_reraise, staged), "save_state", leader=True, group=session.group,
            joining=f"not every rank joined the asynchronous save_state() to {session.final} within "
                    f"{self.run.process.timeout}; save_state() is collective: call it on every rank (not under "
                    "`if accelerator.is_main_process:`), the same number of times")

    # --- asynchronous saves -----------------------------------------------------------------------------------
    def async_default(self) -> bool:
        """``save_state()``'s default: ``ProjectConfiguration.async_save`` or the run config's ``async_save``."""
        return bool(self.config.async_save or self.async_configured)

    def _check_async(self) -> None:
        if self.run.strategy.engine_managed:
            raise ConfigError("save_state(async_save=True) is not supported under DeepSpeed (its engine writes its "
                              "own checkpoint files synchronously); save with async_save=False, or turn off "
                              "ProjectConfiguration(async_save=...) / the async_save config key")

    def wait(self) -> str | None:
        """Wait for the pending asynchronous save (not collective); its path, None when none was pending. Its
        failure raises here as a CheckpointError naming the directory and the cause (on every rank: a failure on
        one rank fails the save on all)."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def drop_staging_buffers(self) -> None:
        """Free the CPU copies the stager keeps for the next asynchronous save (a pending save keeps its own)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def close(self) -> None:
        """``end_training``: wait for the pending save, then drop the staging buffers and the background group."""
        try:
            self.wait()
        finally:
            self.drop_staging_buffers()
            staging.release_group()

    def _needed_bytes(self) -> int:
        return self._needed(self.run.prepared.models, self.run.prepared.inner_optimizers())

    def _prepare(self, final: Path, temp: Path, clean: bool) -> str:
        url = self._uploads.get(str(final))
        if url is not None:  # the object-storage target is checked; its staging directory is impel's own
            remote.check_target(url, self.config.automatic_checkpoint_naming, self.config.iteration)
            if clean:
                remote.clear_staging(final)
        return target.prepare(final, temp, clean, self.config.automatic_checkpoint_naming and url is None,
                              self.config.iteration, self._needed_bytes)

    def _write(self, session: SaveSession, safe_serialization: bool, options: SaveOptions) -> dict[str, object]:
        run, prepared, temp = self.run, self.run.prepared, session.checkpoint_dir
        # every rank creates it (the first one wins; never a symlink or another user's) and holds its lock: no
        # collective of its own; a failure is shared by the write's, so every rank raises and none waits
        tempdirs.make(temp)
        skip = self._run_save_hooks(temp)
        meta = run.strategy.save_checkpoint(session, list(prepared.models), prepared.inner_optimizers(),
                                            safe_serialization=safe_serialization, skip_models=skip, options=options)
        if session.leader:
            for i, scheduler in enumerate(prepared.schedulers):
                write_torch(session, scheduler.state_dict(), temp / f"scheduler{suffix(i)}.pt")
            write_torch(session, collect_training_state(run.step, run.gradient_state, prepared.optimizers,
                                                        prepared.dataloaders, run.strategy.precision_state_dict()),
                        temp / TRAINING_STATE_FILE)
            for i, obj in enumerate(prepared.registered):
                write_registered(session, i, obj, temp / f"custom_checkpoint_{i}.pt")
        write_torch(session, collect_rng_state(run.device, prepared.dataloaders),
                    temp / f"random_states_{run.process_index}.pt")
        return dict(meta, skipped_models=sorted(skip))

    def _run_save_hooks(self, temp: Path) -> frozenset[int]:
        """Accelerate's contract: ``hook(models, weights, output_dir)``; a model whose weights the hook removes
        from the list is saved by the hook, not by impel."""
        if self.run.gradient_state.micro_in_group:
            logger.warning("save_state() in the middle of an accumulation group: the partial gradients are not "
                           "saved; save after optimizer.step() for an exact resume")
        if not self.save_hooks:
            return frozenset()
        models = list(self.run.prepared.models)  # uncompiled: the strategy's own modules
        weights = [self.run.strategy.model_state_dict(m) for m in models]
        ids = [id(w) for w in weights]
        for hook in list(self.save_hooks.values()):
            hook(models, weights, str(temp))
        remaining = {id(w) for w in weights}
        return frozenset(i for i, w in enumerate(ids) if w not in remaining)

    def _metadata(self, strategy_meta: Mapping[str, object]) -> dict[str, object]:
        """The checkpoint's metadata, taken when the save is called (an asynchronous save commits it later)."""
        from impel import __version__

        run = self.run
        return {
            "impel_version": __version__, "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "iteration": self.config.iteration, "step": run.step, "optimizer_steps": run.prepared.optimizer_steps(),
            "world_size": run.num_processes, "gradient_accumulation_steps": run.gradient_state.num_steps,
            "distributed_type": str(run.distributed_type),
            "mixed_precision": run.mixed_precision, "strategy": dict(strategy_meta, name=run.strategy.name),
            "counts": run.prepared.counts(),
        }

    def _commit(self, temp: Path, final: Path, metadata: dict[str, object], known: dict[str, Entry],
                parts: list[dict[str, Metadata]]) -> None:
        for rel in sorted({rel for rank_parts in parts for rel in rank_parts}):  # after the digests were shared
            from impel.checkpoint.formats import dcp_raw

            dcp_raw.write_merged(temp / rel, [rank_parts[rel] for rank_parts in parts if rel in rank_parts])
        layout.commit(temp, final, metadata, known, keep=ownership.carry_user_files)
        url = self._uploads.pop(str(final), None)
        if url is not None:  # sealed locally: upload, the commit object last, then rotate there
            remote.upload(final, url)
            remote.clear_staging(final)
            if self.config.automatic_checkpoint_naming:
                remote.rotate(url.parent, self.config.total_limit)
        elif self.config.automatic_checkpoint_naming:
            layout.rotate(final.parent, self.config.total_limit, ownership.remove_checkpoint)

    # --- load -------------------------------------------------------------------------------------------------
    def load(self, input_dir: remote.Location = None, options: LoadOptions = DEFAULT_LOAD) -> str:
        self.wait()
        collective.arrive("load_state", self.run.process.timeout)
        if input_dir is not None:
            collective.agree(os.fspath(input_dir), "the load_state input directory")
        leader = self._leader()
        found = collective.on_leader(functools.partial(self._locate, input_dir), "checking the checkpoint", leader)
        assert found is not None  # rank 0 always leads, and every rank gets rank 0's result
        path, metadata, next_free = found
        directory = Path(path)
        if metadata.get("format") != accelerate_format.FORMAT:  # else written by Accelerate's save_state
            self._check_counts(directory, metadata)
        collective.run_shared(functools.partial(self._read_any, directory, metadata, options), "load_state")
        saved = metadata.get("iteration")  # None: an Accelerate directory not named checkpoint_N
        self.config.iteration = max(self.config.iteration if saved is None else int(saved) + 1, next_free)
        collective.barrier()
        downloaded, self._downloaded = self._downloaded, None
        if downloaded is not None:  # the leader's local copy of a URL
            shutil.rmtree(downloaded.parent, ignore_errors=True)
        config = self.config
        return remote.source_url(directory, input_dir, config.project_dir, config.automatic_checkpoint_naming) \
            or str(directory)

    def _locate_remote(self, input_dir: remote.Location) -> tuple[str, dict[str, Any], int] | None:
        """``_locate`` for an object-storage URL: the newest committed checkpoint (or ``input_dir``) downloaded."""
        found = remote.locate(input_dir, self.config.project_dir, self.config.automatic_checkpoint_naming)
        if found is None:
            return None
        local, _url, next_free = found
        self._downloaded = local
        return str(local), layout.verify(local, skip=verified.checked_on_read), next_free

    def _locate(self, input_dir: remote.Location) -> tuple[str, dict[str, Any], int]:
        found = self._locate_remote(input_dir)
        if found is not None:
            return found
        if input_dir is None:
            if not self.config.automatic_checkpoint_naming:
                raise ConfigError("load_state() needs input_dir, or ProjectConfiguration(project_dir=..., "
                                  "automatic_checkpoint_naming=True) to load the newest checkpoint")
            root = self.checkpoints_root()
            layout.clean_incomplete(root)
            directory = max(layout.list_complete(root) + accelerate_format.list_accelerate(root),
                            default=(None, None))[1] or layout.latest_complete(root)
        else:
            directory = target.local_path(input_dir, "load_state(input_dir)")
            layout.recover_swap(directory)
            layout.clean_incomplete(directory.parent)
        if layout.is_accelerate_dir(directory):
            metadata = accelerate_format.inspect(directory)
        else:
            # sizes of every file; checksums of the files no impel reader checks while reading (verified.py)
            metadata = layout.verify(directory, skip=verified.checked_on_read)
        next_free = layout.next_free_iteration(directory.parent) if self.config.automatic_checkpoint_naming else 0
        return str(directory), metadata, next_free

    def _check_counts(self, directory: Path, metadata: dict[str, Any]) -> None:
        saved = metadata.get("counts", {})
        for kind, have in self.run.prepared.counts().items():
            if saved.get(kind, have) != have:
                raise layout.CheckpointError(
                    f"{directory} was saved with {saved[kind]} {kind} but {have} are prepared now; prepare (and "
                    "register) the same objects in the same order before load_state()")
        if metadata.get("world_size") != self.run.num_processes and not self.elastic:  # elastic: resilience says it
            logger.warning("%s was saved by %s processes and is loaded by %d: model and optimizer state are "
                           "resharded and the data position converted, but per-rank RNG streams follow a different "
                           "layout",
                           directory, metadata.get("world_size"), self.run.num_processes)

    def _run_load_hooks(self, directory: Path) -> frozenset[int]:
        """Accelerate's contract: ``hook(models, input_dir)``; models the hook removes are loaded by the hook."""
        if not self.load_hooks:
            return frozenset()
        prepared = self.run.prepared.models
        models = list(prepared)
        for hook in list(self.load_hooks.values()):
            hook(models, str(directory))
        return frozenset(i for i, m in enumerate(prepared) if not any(m is x for x in models))

    def _read_any(self, directory: Path, metadata: dict[str, Any], options: LoadOptions) -> None:
        """The load hooks, then impel's files (:meth:`_read`, each checked against the manifest as it is read) or
        a directory Accelerate's save_state wrote."""
        skip = self._run_load_hooks(directory)
        if metadata.get("format") == accelerate_format.FORMAT:
            accelerate_format.load(self.run, directory, metadata, skip, options)
        else:
            self._read(verified.Manifest.of(directory, metadata), directory, metadata, skip, options)

    def _read(self, manifest: verified.Manifest, directory: Path, metadata: dict[str, Any], skip: frozenset[int],
              options: LoadOptions) -> None:
        run, prepared = self.run, self.run.prepared
        training = read_torch(manifest, directory / TRAINING_STATE_FILE, "training state")
        run.strategy.load_precision_state_dict(training["precision"])  # the scaler before the optimizers (FSDP2)
        run.strategy.load_checkpoint(manifest, list(prepared.models), prepared.inner_optimizers(), directory,
                                     metadata["strategy"], skip_models=skip, options=options)
        for i, scheduler in enumerate(prepared.schedulers):
            scheduler.load_state_dict(read_torch(manifest, directory / f"scheduler{suffix(i)}.pt", f"scheduler {i}"))
        run.gradient_state.set_step(restore_training_state(training, run.gradient_state, prepared.optimizers,
                                                           prepared.dataloaders))
        for i, obj in enumerate(prepared.registered):
            obj.load_state_dict(read_torch(manifest, directory / f"custom_checkpoint_{i}.pt",
                                           f"registered object {i}, {describe(obj)}"))
        rng = directory / f"random_states_{run.process_index}.pt"
        if rng.is_file():
            restore_rng_state(read_torch(manifest, rng, f"rank {run.process_index} RNG state"), run.device,
                              prepared.dataloaders)
        elif not self.elastic:  # an elastic job that grew: expected, and its resume line says so
            logger.warning("%s has no RNG state for rank %d (saved by %s processes); this rank's random streams "
                           "start fresh", directory, run.process_index, metadata.get("world_size"))
