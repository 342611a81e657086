"""Checkpoints on object storage: ``save_state`` to a local S3 API server (moto in server mode, through s3fs)
against the same bytes uploaded by s3fs directly (``put_file`` of each file of the saved checkpoint), in the same
run. The ratio is impel's overhead over a plain upload (its local staging write, sealing, the commit object).
Needs the dev extra's moto[server] and s3fs; not part of ``make test``."""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "objstore"
DESCRIPTION = "save_state to a local moto S3 server vs the same bytes uploaded by s3fs directly"
HERE = Path(__file__).resolve().parent


def _state(quick: bool) -> tuple[Any, Any, Any]:
    import torch

    from impel import Accelerator

    width = 256 if quick else 2048
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4 if quick else 8)])
    opt = torch.optim.AdamW(model.parameters())
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return acc, model, opt


def run(quick: bool = False) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from s3_helpers import s3_server

    repeats = 1 if quick else 3
    with s3_server() as env:
        os.environ.update(env)
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        acc, _model, _opt = _state(quick)
        saves, puts, size = [], [], 0
        with tempfile.TemporaryDirectory() as home:
            for i in range(repeats):
                t0 = time.perf_counter()
                acc.save_state(f"s3://bench/impel-{i}")
                saves.append(time.perf_counter() - t0)
                local = Path(home) / f"copy-{i}"
                fs.get(f"bench/impel-{i}", str(local), recursive=True)
                files = [p for p in local.rglob("*") if p.is_file()]
                size = sum(p.stat().st_size for p in files)
                t0 = time.perf_counter()
                for path in files:
                    fs.put_file(str(path), f"bench/plain-{i}/{path.relative_to(local).as_posix()}")
                puts.append(time.perf_counter() - t0)
    save, put = statistics.median(saves), statistics.median(puts)
    rows = [{"what": "save_state('s3://...')", "seconds": round(save, 3), "MB/s": round(size / save / 1e6, 1)},
            {"what": "s3fs put_file, same bytes", "seconds": round(put, 3), "MB/s": round(size / put / 1e6, 1)}]
    return {"rows": rows, "summary": [f"checkpoint {size / 1e6:.1f} MB; save/put time ratio {save / put:.2f} "
                                      f"(median of {repeats})"]}


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
