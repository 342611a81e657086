"""FSDP FULL_STATE_DICT loads read each rank's own shards from the full files (``checkpoint/formats/full_slices.py``):
the loaded parameters and optimizer states equal the saved ones bit for bit (uneven shards: 7 rows on 2 ranks), no
collective scatters them, a model that does not fit raises naming the parameter before anything is read, and
``strict=False`` loads the matching keys and leaves the rest untouched."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from impel.testing import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

FULL = {"distributed_type": "FSDP", "use_cpu": True,
        "fsdp_config": {"fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_auto_wrap_policy": "NO_WRAP"}}


class Net(nn.Module):
    def __init__(self, extra: bool = False, width: int = 5) -> None:
        super().__init__()
        self.first = nn.Linear(width, 7)  # 7 rows: shards of 4 and 3
        self.second = nn.Linear(7, 3)
        if extra:
            self.adapter = nn.Parameter(torch.full((3,), 7.0))  # not in the checkpoint

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _fresh(acc, lr: float = 1e-2, **kwargs) -> tuple:
    acc.prepared.clear()  # a load pairs prepared objects by count: only the new pair
    model = Net(**kwargs)
    return acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))


def _job(root: str) -> dict:
    import torch.distributed as dist

    from impel import Accelerator
    from impel.checkpoint import CheckpointError

    acc = Accelerator()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    for step in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + acc.process_index))
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    path = acc.save_state(os.path.join(root, "ck"))
    saved = {k: _local(v) for k, v in model.state_dict().items()}
    saved_opt = [{k: _local(v) for k, v in opt.state[p].items()} for p in model.parameters()]
    out: dict = {}

    torch.manual_seed(1)  # a fresh run: other weights, an optimizer that never stepped
    fresh_model, fresh_opt = _fresh(acc, lr=5.0)
    scatters = []
    original = dist.scatter
    dist.scatter = lambda *a, **k: scatters.append(1) or original(*a, **k)  # type: ignore[assignment]
    try:
        acc.load_state(path)
    finally:
        dist.scatter = original
    out["scatters"] = len(scatters)
    out["params_equal"] = all(torch.equal(_local(v), saved[k]) for k, v in fresh_model.state_dict().items())
    out["opt_equal"] = all(torch.equal(_local(fresh_opt.state[p][k]), s[k])
                           for p, s in zip(fresh_model.parameters(), saved_opt) for k in s)
    out["lr"] = fresh_opt.param_groups[0]["lr"]

    extra, _ = _fresh(acc, extra=True)
    for strict in (True, False):
        try:
            acc.load_state(path, strict=strict)
            out[f"strict={strict}"] = "loaded"
        except CheckpointError as exc:
            out[f"strict={strict}"] = str(exc)
    out["adapter"] = sorted(set(_local(extra.adapter).tolist()))  # this rank's shard of it
    out["extra_first_equal"] = torch.equal(_local(extra.first.weight), saved["first.weight"])

    _fresh(acc, width=6)
    try:
        acc.load_state(path)
        out["wider"] = "loaded"
    except CheckpointError as exc:
        out["wider"] = str(exc)
    acc.end_training()
    return out


def test_full_loads_read_each_ranks_own_shards(tmp_path):
    env = {"IMPEL_CONFIG": json.dumps(FULL)}
    results = run_on_ranks(_job, 2, args=(str(tmp_path),), timeout=120, env=env)
    for out in results:
        assert out["scatters"] == 0  # nothing redistributed over the process group
        assert out["params_equal"] and out["opt_equal"] and out["lr"] == 1e-2
        assert "does not fit prepared model" in out["strict=True"] and "adapter" in out["strict=True"]
        assert out["strict=False"] == "loaded" and out["adapter"] == [7.0] and out["extra_first_equal"]
        assert "has shape [7, 5] in the checkpoint but [7, 6] in the model" in out["wider"]
