"""Hostfiles of MPI and DeepSpeed's runner (``impel launch --mpirun_hostfile`` / ``--deepspeed_hostfile``, and
``impel config convert``): one host per line, ``host``, ``host:N`` (MPICH) or ``host slots=N`` (Open MPI, DeepSpeed);
``#`` starts a comment."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from impel.config.schema import ConfigError


@dataclass(frozen=True)
class HostLine:
    """One host of a hostfile: its line number, name and slot count (None: the line gives none)."""

    number: int
    host: str
    slots: int | None
    text: str


def hostfile_lines(path: str, what: str) -> list[HostLine]:
    """The hosts a hostfile names, in order (``host``, ``host:N``, ``host slots=N``; ``#`` starts a comment)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{what} {path!r} does not exist or is not a file; pass the hostfile that lists "
                          "the machines (one per line: 'host slots=N' for Open MPI, 'host:N' for MPICH)")
    out = []
    for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        name, slots = words[0], None
        if name.count(":") == 1:
            name, _, count = name.partition(":")
            slots = int(count) if count.isdigit() else None
        for word in words[1:]:
            key, _, count = word.partition("=")
            if key == "slots" and count.isdigit():
                slots = int(count)
        out.append(HostLine(number, name, slots, line.strip()))
    if not out:
        raise ConfigError(f"{what} {path!r} lists no host; write one machine per line ('host slots=N' for "
                          "Open MPI, 'host:N' for MPICH)")
    return out
