"""What every prepared DataLoader does (:class:`PreparedLoader`): this rank's batches, on the device, with epoch,
position, ``end_of_dataloader`` and the random states an exact resume replays.

Accelerate's two public kinds, :class:`impel.runtime.loaders.data.DataLoaderShard` (each rank reads its shard) and
:class:`impel.runtime.loaders.data.DataLoaderDispatcher` (rank 0 reads, every rank receives), are subclasses with
Accelerate's constructors; ``prepare`` builds them through :meth:`PreparedLoader.build`."""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, SequentialSampler

from impel.runtime.loaders.loader_attributes import loader_attributes
from impel.runtime.loaders.samplers import SeedableRandomSampler
from impel.runtime.loaders.seeding import synchronize_rng_states
from impel.runtime.ranks.collectives import send_to_device

_END = object()


class PreparedLoader(DataLoader[Any]):
    """A prepared DataLoader: this rank's batches, on the device, with epoch and position tracking.

    A ``torch.utils.data.DataLoader`` (``isinstance`` holds) with its attributes (``batch_sampler``, ``drop_last``,
    ``num_workers``, ...: :mod:`impel.runtime.loaders.loader_attributes`); it iterates ``base_dataloader``, the
    loader over this rank's shard.

    Iterating it sets ``end_of_dataloader`` while the last batch is being used (one batch of look-ahead), which
    gradient accumulation and ``gather_for_metrics`` read. A complete pass advances the epoch by itself, so
    shuffles differ per epoch even without ``set_epoch``; ``set_epoch(n)`` sets it explicitly.

    The constructor is the subclass's (Accelerate's); :meth:`build` makes one from its parts, as ``prepare`` does.
    """

    synchronized_generator: torch.Generator | None = None  # Accelerate's: shared from rank 0 with rng_types
    _skip_each_pass = 0  # Accelerate's skip_batches=N constructor argument: every pass starts N batches in

    @classmethod
    def build(cls, loader: object, shard: object, device: torch.device | None, non_blocking: bool,
              gradient_state: object, per_rank_batch: int, original: DataLoader,
              rng_types: list[str] | None = None, hooks: object = None) -> Any:
        """A ``cls`` iterating ``loader`` (the rebuilt loader over this rank's ``shard``), built without running the
        subclass's constructor."""
        built = cls.__new__(cls)
        built._setup(loader, shard, device, non_blocking, gradient_state, per_rank_batch, original, rng_types, hooks)
        return built

    def _setup(self, loader: Any, shard: Any, device: torch.device | None, non_blocking: bool,
               gradient_state: Any, per_rank_batch: int, original: DataLoader,
               rng_types: list[str] | None = None, hooks: Any = None) -> None:
        self.base_dataloader = loader
        self.rng_types = [t for t in rng_types or [] if t != "generator"]  # shared from rank 0 at each pass
        self.shard = shard
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.total_batch_size: int | None = per_rank_batch * getattr(shard, "world", 1)
        self.original = original
        # epoch, position and the pass's random states live in one shared record, so a skip_first_batches() view
        # advances the original, consumes a resume pending on it, and leaves its pass start for state_dict()
        self._progress: dict[str, Any] = {"epoch": 0, "position": 0, "pass_start": None, "resume_rng": None,
                                          "fetch_rng": None, "resume_fetch": None}
        self.hooks = hooks  # impel.accelerator.resilience.Resilience (auto-resume and preemption checks), or None
        self.end_of_dataloader = False
        self._skip_next = 0
        self.__dict__.update(loader_attributes(loader, original, getattr(shard, "sampler", None),
                                               getattr(shard, "per_rank_batch", None)))

    epoch = property(lambda self: self._progress["epoch"],
                     lambda self, value: self._progress.__setitem__("epoch", value),
                     doc="The epoch the next (or current) pass uses for its shuffle.")
    position = property(lambda self: self._progress["position"],
                        lambda self, value: self._progress.__setitem__("position", value),
                        doc="Batches of the current epoch consumed, skipped ones included.")
    iteration = property(lambda self: self.epoch, lambda self, value: setattr(self, "epoch", value),
                         doc="Accelerate's name for ``epoch``.")
    total_dataset_length = property(lambda self: getattr(self.dataset, "total_length", None) or len(self.dataset),
                                    doc="Samples in the dataset on all ranks together (Accelerate's attribute).")
    _pass_start = property(lambda self: self._progress["pass_start"],  # random states the current pass started from
                           lambda self, value: self._progress.__setitem__("pass_start", value))
    _resume_rng = property(lambda self: self._progress["resume_rng"],  # set by load_state_dict, used by the next pass
                           lambda self, value: self._progress.__setitem__("resume_rng", value))

    def __len__(self) -> int:
        return len(self.base_dataloader)  # batches of this rank's shard; a TypeError for unsized iterables

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self.shard.set_epoch(epoch)  # at once, as Accelerate's (a batch sampler's epoch reads back); again per pass

    @property
    def remainder(self) -> int:
        return self.shard.last_batch_size()

    def remaining_batches(self) -> int | None:
        """Batches left in this epoch, counting the one in use, or None when the length is unknown."""
        try:
            return len(self) - self.position + 1
        except TypeError:
            return None

    def skip_batches(self, num_batches: int) -> None:
        """Make the next iteration start ``num_batches`` into the epoch (without loading them)."""
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be >= 0")
        self._skip_next = num_batches

    def _start_epoch(self) -> None:
        self.shard.set_epoch(self.epoch)
        skip = self._skip_next or self._skip_each_pass
        self.shard.skip = skip
        self.position = skip
        self._skip_next = 0

    # --- the random states a pass draws from (exact resume) --------------------------------------------------
    def _generators(self) -> dict[str, torch.Generator]:
        """The generators a pass draws from: the loader's (worker base seed) and the order sampler's."""
        gens = {}
        loader_gen = self.base_dataloader.generator
        if loader_gen is not None:
            gens["loader"] = loader_gen
        order_gen = getattr(self.sampler, "generator", None)
        if isinstance(order_gen, torch.Generator) and order_gen is not loader_gen \
                and not isinstance(self.sampler, SeedableRandomSampler):  # that one is re-seeded every pass
            gens["order"] = order_gen
        return gens

    def _draws_from_global_rng(self) -> bool:
        """A pass draws from torch's global RNG: the worker base seed, or a sampler without a generator."""
        sampler = self.sampler
        unseeded = sampler is not None and not isinstance(sampler, SequentialSampler) \
            and getattr(sampler, "generator", None) is None
        return self.base_dataloader.generator is None or unseeded

    def _begin_pass(self) -> tuple[Iterator[Any], Any]:
        """Start the base loader's pass and fetch its first batch.

        A pass draws its worker base seed and its order when it starts. A resumed pass mid-epoch replays those
        draws from the states the interrupted pass started from: generators are set back, and torch's global RNG
        is swapped in only for the start, so the live global stream (restored by ``load_state``) is not consumed
        twice.
        """
        resume, self._resume_rng = self._resume_rng, None
        replay = (resume or {}).get("global")
        if replay is None and self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)  # as Accelerate's, rank 0's
        gens = self._generators()
        for name, state in (resume or {}).items():
            if name in gens:
                gens[name].set_state(state)
        start = {name: gen.get_state() for name, gen in gens.items()}
        if replay is not None:
            start["global"] = replay
        elif self._draws_from_global_rng():
            start["global"] = torch.get_rng_state()
        self._pass_start = start
        fetch, self._progress["resume_fetch"] = self._progress["resume_fetch"], None
        if fetch is not None and (getattr(self.shard, "skip", 0) < 1 or hasattr(self.base_dataloader, "at_end")):
            fetch = None
        live = torch.get_rng_state() if replay is not None or fetch is not None else None
        if replay is not None:
            torch.set_rng_state(replay)
        try:
            if fetch is not None:  # batch position+1 drew from the global RNG when first fetched: fetch it again so
                self.shard.skip -= 1  # (one batch earlier, discarded, draws the pass's order as the first fetch did)
            it = iter(self.base_dataloader)
            first = next(it, _END)
            if fetch is not None:
                torch.set_rng_state(fetch)  # the global RNG as it was just before the interrupted run fetched it
                first = next(it, _END)
            return it, first
        finally:
            if live is not None:
                torch.set_rng_state(live)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not torch's _BaseDataLoaderIter
        hooks = self.hooks
        if hooks is not None:
            hooks.on_iter_start(self)  # auto-resume: may restore epoch and position before the epoch starts
        self._start_epoch()
        self.end_of_dataloader = False
        state = self.gradient_state
        state.register_dataloader(self)
        finished = False
        try:
            it, current = self._begin_pass()
            if current is _END and self.position == 0:
                _warn_empty(self)
            if not getattr(self.shard, "even_batches", True):
                _warn_uneven(self)
            # one batch of look-ahead, unless the base loader tells its end itself (a dispatcher reads one ahead
            # already: a second would draw the sampler further than Accelerate's does)
            knows_end = hasattr(self.base_dataloader, "at_end")
            # per batch: plain dict writes (torch's DataLoader.__setattr__ and the position property are Python calls)
            attributes, progress, device = self.__dict__, self._progress, self.device
            draws: bool | None = None  # does fetching a batch draw from torch's global RNG (a masking collator)?
            while current is not _END:
                if hooks is not None:
                    hooks.before_batch(self)  # preemption: a step boundary, before this batch counts as drawn
                if knows_end:
                    upcoming = None
                elif draws is False:
                    upcoming = next(it, _END)
                else:  # the global RNG before each look-ahead fetch, for a checkpoint taken before its batch is used
                    before = torch.get_rng_state()
                    upcoming = next(it, _END)
                    if draws is None:
                        draws = not torch.equal(before, torch.get_rng_state())
                    progress["fetch_rng"] = (self.epoch, progress["position"] + 2, before) if draws else None
                attributes["end_of_dataloader"] = self.base_dataloader.at_end if knows_end else upcoming is _END
                progress["position"] += 1
                if device is not None:
                    current = send_to_device(current, device, self.non_blocking)
                yield current
                current = next(it, _END) if knows_end else upcoming
            finished = True
        finally:
            self.end_of_dataloader = False
            self._progress["fetch_rng"] = None
            state.unregister_dataloader(self)
            if finished:
                self.epoch += 1
                self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position in it, and the random states that make a resumed pass draw the same order."""
        # a skip set by load_state_dict/skip_batches and not yet iterated is the position to save
        position = self._skip_next or self.position
        state: dict[str, Any] = {"epoch": self.epoch, "position": position}
        if isinstance(self.sampler, SeedableRandomSampler):
            state["seed"] = self.sampler.seed
        if self._resume_rng is not None:
            state["rng"] = self._resume_rng
        elif self.position > 0 and not self._skip_next and self._pass_start is not None:
            state["rng"] = self._pass_start  # mid-epoch: what this pass started from
        else:  # between passes: the generators as they are (the global RNG is saved with the process's RNG)
            state["rng"] = {name: gen.get_state() for name, gen in self._generators().items()}
        return state

    def fetch_rng_state(self) -> dict[str, Any] | None:
        """This rank's part of an exact resume when fetching batches draws from torch's global RNG (a collator that
        masks at random): the global RNG just before the next batch, already fetched (one batch of look-ahead), was
        drawn. Saved per rank with the RNG states; None between passes or when fetching draws nothing."""
        pending = self._progress["fetch_rng"]
        if pending is None or self._skip_next or pending[1] != self.position + 1:
            return None
        epoch, position, rng = pending
        return {"epoch": epoch, "position": position - 1, "rng": rng}

    def resume_fetch_rng(self, saved: dict[str, Any] | None) -> None:
        """After :meth:`load_state_dict`: the next pass fetches its first batch from ``saved``'s RNG state (when it
        belongs to the position being resumed: not after a change of world size moved it)."""
        if saved is not None and int(saved["epoch"]) == self.epoch and int(saved["position"]) == self._skip_next:
            self._progress["resume_fetch"] = saved["rng"]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.skip_batches(int(state["position"]))
        if isinstance(self.sampler, SeedableRandomSampler) and state.get("seed") is not None:
            self.sampler.seed = int(state["seed"])
        rng = state.get("rng") or {}
        if int(state["position"]) == 0:
            rng = {k: v for k, v in rng.items() if k != "global"}
        self._resume_rng = dict(rng) or None


def _warn_uneven(loader: PreparedLoader) -> None:
    """``even_batches=False`` outside ``join_uneven_inputs``, ranks given different numbers of batches: the ranks
    with more wait in their next all-reduce for ranks that left the loop (until the group timeout). Once a loader."""
    shard = loader.shard
    if shard.joined or shard.world == 1 or shard.rank != 0 or loader.__dict__.get("_warned_uneven"):
        return
    counts = shard.rank_batches()
    if counts is None or len(set(counts)) == 1:
        return
    loader.__dict__["_warned_uneven"] = True
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
    warnings.warn(f"DataLoaderConfiguration(even_batches=False) gives the ranks different numbers of batches per "
                  f"pass ({per_rank}): a step that all-reduces (DDP's backward, gather, wait_for_everyone) on a rank "
                  "with more batches waits for the ranks that finished until the group timeout; train inside "
                  "`with accelerator.join_uneven_inputs([model]):` (DDP), or keep even_batches=True", stacklevel=3)


def _warn_empty(loader: PreparedLoader) -> None:  # an empty dataset, or every batch dropped by drop_last
    world, data = getattr(loader.shard, "world", 1), loader.dataset
    if world == 1 or loader.shard.even_batches:  # else another rank may have the batches: nothing is wrong
        count = f"{len(data)} samples" if hasattr(data, "__len__") else "no length (an iterable)"
        warnings.warn(f"a prepared DataLoader gave this rank no batch: its dataset has {count}, batch_size="
                      f"{loader.batch_size} per process on {world} process(es), drop_last={loader.original.drop_last}"
                      "; the loop runs no step: check the dataset, or lower batch_size / drop_last=False", stacklevel=3)
