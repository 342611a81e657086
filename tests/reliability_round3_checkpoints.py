"""Rows of docs/reliability.md for issue 36's checkpoint inputs (round 3) that ``reliability_cases.collect`` runs in
this process: targets a save cannot rename a new directory onto (a symbolic link, a file in the path, a mount
point) and manifests that must not be trusted (a newer format, paths outside the checkpoint). Each row also checks
that nothing of the user's was lost or replaced and that no temporary directory was left."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = tuple[str, str, str]
Raises = Callable[[Callable[[], object]], str]


def round3_checkpoint_rows(work: Path, raises: Raises, prepared: Callable[[int], Any]) -> list[Row]:
    root = work / "round3_ckpt"
    root.mkdir()
    acc = prepared(8)
    return _target_rows(root, acc, raises) + _manifest_rows(root, acc, raises)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".impel-"))


def _target_rows(root: Path, acc: Any, raises: Raises) -> list[Row]:
    real, link = root / "real_ck", root / "link_ck"
    acc.save_state(str(real))
    link.symlink_to("real_ck", target_is_directory=True)
    rows = [("checkpoint", "`save_state(\"link_ck\")` where `link_ck` is a symbolic link to a checkpoint",
             raises(lambda: acc.save_state(str(link))))]
    assert link.is_symlink() and os.readlink(link) == "real_ck", "the link was replaced"
    (root / "afile").write_text("mine")
    rows.append(("checkpoint", "`save_state(\"afile/ck\")` where `afile` is a file",
                 raises(lambda: acc.save_state(str(root / "afile" / "ck")))))
    assert (root / "afile").read_text() == "mine"
    assert _leftovers(root) == [], _leftovers(root)
    acc.load_state(str(link))
    return rows


def _reseal(directory: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Edit the manifest and rewrite the completion marker to match, as anyone who can write the directory can."""
    meta = json.loads((directory / "impel_checkpoint.json").read_text())
    change(meta)
    text = json.dumps(meta, indent=1, sort_keys=True)
    (directory / "impel_checkpoint.json").write_text(text)
    (directory / "COMPLETE").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def _rotating(project: Path) -> Any:
    import torch
    from torch import nn

    from impel import Accelerator, ProjectConfiguration
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(project), automatic_checkpoint_naming=True,
                                                                    total_limit=1))
    model = nn.Linear(4, 1)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc


def _manifest_rows(root: Path, acc: Any, raises: Raises) -> list[Row]:
    newer = root / "ck9"
    acc.save_state(str(newer))
    _reseal(newer, lambda meta: meta.__setitem__("format_version", 99))
    rows = [("checkpoint", "`load_state` of a checkpoint whose manifest says `format_version: 99` (resealed)",
             raises(lambda: acc.load_state(str(newer))))]
    project = root / "project"
    acc = _rotating(project)
    acc.save_state()
    first = project / "checkpoints" / "checkpoint_0"
    victim = root / "victim.txt"
    victim.write_text("precious")
    entry = {"size": 8, "xxh3_128_blocks": ["0" * 32]}
    _reseal(first, lambda meta: meta["files"].__setitem__("../../../victim.txt", entry))
    rows.append(("checkpoint", "a checkpoint whose manifest was made to name `../../../victim.txt` (resealed), "
                 "`load_state` of it (the next `save_state()` with `total_limit=1` rotates it out and keeps the file)",
                 raises(lambda: acc.load_state(str(first)))))
    acc.save_state()
    assert victim.read_text() == "precious"
    return rows
