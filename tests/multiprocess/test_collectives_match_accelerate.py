"""impel's collectives (``impel.utils`` / ``impel.utils.operations``) against Accelerate's, called the same way on 2
CPU ranks over gloo in the same processes: defaults, keyword names, reductions and debug mode's errors."""
from __future__ import annotations

import pytest
import torch

from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess
pytest.importorskip("accelerate")


def _calls(ops, rank: int) -> dict[str, object]:
    t = torch.tensor([1.0, 2.0]) + 2 * rank
    return {
        "reduce_default": ops.reduce(t).tolist(),
        "reduce_sum": ops.reduce(tensor=t, reduction="sum").tolist(),
        "reduce_mean": ops.reduce(t, "mean").tolist(),
        "reduce_max": ops.reduce(t, reduction="max").tolist(),
        "reduce_nested": {k: v.tolist() for k, v in ops.reduce({"a": t, "b": t * 2}, "sum").items()},
        "gather": ops.gather(tensor=t).tolist(),
        "gather_nested": [x.tolist() for x in ops.gather([t, t + 1])],
        "gather_object": ops.gather_object(object=[f"rank{rank}"]),
        "broadcast": ops.broadcast(tensor=t.clone(), from_process=1).tolist(),
        "broadcast_object_list": ops.broadcast_object_list(object_list=[rank, "x"], from_process=1),
        "pad": ops.pad_across_processes(tensor=torch.ones(rank + 1, 2), dim=0, pad_index=-1,
                                        pad_first=True).tolist(),
        "send": str(ops.send_to_device(tensor={"a": t, "b": t}, device="cpu", skip_keys="b")["a"].device),
    }


def _debug_errors(state, ops, rank: int) -> dict[str, str]:
    state.debug = True
    out = {}
    shapes = {"tensor": torch.ones(1, 5) if rank == 0 else torch.ones(1, 1, 6)}
    for name, call in (("gather", lambda: ops.gather(shapes)), ("reduce", lambda: ops.reduce(shapes)),
                       ("broadcast", lambda: ops.broadcast(shapes)),
                       ("pad", lambda: ops.pad_across_processes(shapes, dim=0))):
        try:
            call()
            out[name] = "ran"
        except ops.DistributedOperationException as error:
            out[name] = type(error).__name__ + (": chained" if error.__cause__ is not None else "")
    state.debug = False
    return out


def _both():
    import accelerate
    import accelerate.utils.operations as theirs

    import impel
    import impel.utils.operations as mine

    rank = impel.PartialState().process_index
    accelerate.PartialState(cpu=True)  # Accelerate's collectives read its state; both use torch's one process group
    # Accelerate's copy_tensor_to_devices fails on CPU ranks (IndexError in gather_tensor_shape): impel's alone
    copied = mine.copy_tensor_to_devices(torch.tensor([[7, 8]]) if rank == 0 else None).tolist()
    return {"impel": _calls(mine, rank), "accelerate": _calls(theirs, rank), "copied": copied,
            "impel_debug": _debug_errors(impel.PartialState(), mine, rank),
            "accelerate_debug": _debug_errors(accelerate.PartialState(), theirs, rank)}


def test_collectives_equal_accelerates_on_two_ranks(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    results = run_on_ranks(_both, 2, timeout=120)
    for rank, result in enumerate(results):
        assert result["impel"] == result["accelerate"], rank
        assert result["impel"]["reduce_default"] == [2.0, 3.0]  # the mean, as Accelerate's default
        assert result["impel_debug"] == result["accelerate_debug"], rank
        assert result["impel_debug"]["gather"] == "DistributedOperationException"
        assert result["copied"] == [[7, 8]]
