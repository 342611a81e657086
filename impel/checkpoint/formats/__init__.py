"""The checkpoint formats impel writes (a room of ``impel.checkpoint``, layer 3), in one table that the writers,
the verifier and the merger all read.

Modules: ``full`` (model and optimizer as full files: single device, DDP, FSDP FULL_STATE_DICT), ``cooperative``
(FULL_STATE_DICT files written by every rank), ``full_slices`` (FULL_STATE_DICT read back by every rank, its own
shards only), ``sharded`` (DCP: FSDP SHARDED_STATE_DICT, resharding), ``dcp_raw`` (DCP shard files of raw bytes,
planned per rank), ``deepspeed_engines`` (DeepSpeed engines' own checkpoints, loaded safely, and their merge),
``named_state`` (state dicts by name, names recorded at the first save), ``hf`` (Hugging Face's weight layout),
``merge`` (any checkpoint to full weights, ``impel merge-weights``).

A strategy's ``save_checkpoint`` returns the ``strategy`` section of a checkpoint's metadata, whose ``format`` names
one entry of :data:`FORMATS`. The entry says

* ``name``: the ``format`` value its writer records (``full.FORMAT``, ``sharded.FORMAT``, ...);
* ``merger``: ``"module:function"`` giving one model's full state dict (``impel merge-weights``, ``merge.py``),
  imported only when that format is merged;
* ``read_checked``: the relative paths (regular expressions) its reader opens through ``verified.open_checked``,
  so verified while they are read; ``load_state`` hashes every other file of the manifest up front
  (``verified.checked_on_read``).

:data:`COMMON_READ_CHECKED` lists the files ``save_state`` writes whatever the format (schedulers, the training
state, registered objects, each rank's RNG state), all read through impel's checked readers.

Adding a format: its writer and reader (see ``session.SaveSession`` and ``verified.Manifest``), one entry here,
and the strategy that writes it (``tests/unit/test_save_session.py`` checks the table against the writers).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["COMMON_READ_CHECKED", "DEEPSPEED", "FORMATS", "FULL", "SHARDED", "Format", "read_checked_pattern"]


@dataclass(frozen=True)
class Format:
    """One checkpoint format (see the module docstring)."""
    name: str
    merger: str
    read_checked: tuple[str, ...]


FULL = Format("full", "impel.checkpoint.formats.merge:full_weights",
              (r"(model|optimizer)(_\d+)?\.(safetensors|pt)", r"pytorch_model(_\d+)?\.bin"))
SHARDED = Format("sharded", "impel.checkpoint.formats.merge:sharded_weights",
                 (r"(model|optimizer)(_\d+)?/(\.metadata|[^/]+\.distcp)",))
# DeepSpeed's engines read their own files: all of them are verified up front
DEEPSPEED = Format("deepspeed", "impel.checkpoint.formats.deepspeed_engines:merge_zero_checkpoint", ())
FORMATS: dict[str, Format] = {f.name: f for f in (FULL, SHARDED, DEEPSPEED)}

COMMON_READ_CHECKED = (r"scheduler(_\d+)?\.(safetensors|pt)", r"training_state\.pt", r"custom_checkpoint_\d+\.pt",
                       r"random_states_\d+\.pt")


def read_checked_pattern() -> re.Pattern[str]:
    """One pattern matching every relative path some format's reader (or ``save_state``'s own) verifies while
    reading it."""
    patterns = [*COMMON_READ_CHECKED, *(p for f in FORMATS.values() for p in f.read_checked)]
    return re.compile("|".join(f"^(?:{p})$" for p in patterns))
