"""Sharded saves plan without collectives (``checkpoint/formats/dcp_raw.py``: each rank plans its own items, the
committing rank merges their metadata): on 2 ranks under FSDP2 (uneven shards, AdamW), the merged ``.metadata``
describes the same tensors, chunks and stored items as DCP's own coordinated save of the same state, and DCP's
planning and result collectives are not called by ``save_state``."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from impel.testing import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SHARDED = {"distributed_type": "FSDP", "use_cpu": True,
           "fsdp_config": {"fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_auto_wrap_policy": "NO_WRAP"}}


def _describe(path: str) -> dict:
    from impel.checkpoint.formats.sharded import _MetadataUnpickler

    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = _MetadataUnpickler(f).load()
    tensors = {}
    for fqn, entry in meta.state_dict_metadata.items():
        chunks = sorted((list(c.offsets), list(c.sizes)) for c in getattr(entry, "chunks", []))
        tensors[fqn] = (type(entry).__name__, list(getattr(entry, "size", [])), str(getattr(
            getattr(entry, "properties", None), "dtype", None)), chunks)
    stored = sorted((index.fqn, list(index.offset or [])) for index in meta.storage_data)
    return {"tensors": tensors, "stored": stored, "planner_data": sorted(meta.planner_data)}


def _job(root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from impel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 7 rows: shards of 4 and 3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(acc.process_index))
    acc.backward(model(x).square().mean())
    opt.step()
    calls = []
    names = ("gather_object", "scatter_object_list", "broadcast_object_list")  # DCP's planning and results
    originals = {name: getattr(dist, name) for name in names}
    for name, fn in originals.items():
        setattr(dist, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    try:
        path = acc.save_state(os.path.join(root, "impel"))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(root, "dcp", "model"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(root, "dcp", "optimizer"))
    out = {"dcp_collectives": len(calls)}
    if acc.is_main_process:
        for name in ("model", "optimizer"):
            out[name] = (_describe(os.path.join(path, name)), _describe(os.path.join(root, "dcp", name)))
    acc.end_training()
    return out


def test_sharded_saves_merge_the_metadata_dcp_would_write(tmp_path):
    results = run_on_ranks(_job, 2, args=(str(tmp_path),), timeout=120, env={"IMPEL_CONFIG": json.dumps(SHARDED)})
    assert [r["dcp_collectives"] for r in results] == [0, 0]
    for name in ("model", "optimizer"):
        ours, theirs = results[0][name]
        assert ours == theirs, name
        assert any(len(chunks) == 2 for _, _, _, chunks in ours["tensors"].values())  # both ranks' shards listed
