"""Process state, collectives and data order on 2 real ranks over gloo."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import IndexDataset
from impel.testing import RankFailed, run_on_ranks

pytestmark = pytest.mark.multiprocess


def _state_and_collectives():
    import torch.distributed as dist

    from impel import Accelerator

    acc = Accelerator()  # no cpu=True: a CPU-only box must still distribute (gloo), never train replicas
    r = acc.process_index
    out = {
        "backend": dist.get_backend(), "type": acc.distributed_type, "n": acc.num_processes,
        "main": acc.is_main_process, "last": acc.is_last_process, "local": acc.local_process_index,
        "gather": acc.gather(torch.tensor([r, r + 10])).tolist(),
        "gather_scalar": acc.gather(torch.tensor(float(r))).tolist(),
        "sum": acc.reduce(torch.tensor([r + 1.0])).item(),
        "mean": acc.reduce(torch.tensor([r + 1.0]), reduction="mean").item(),
        "padded": acc.pad_across_processes(torch.ones(r + 1, 2), dim=0).shape[0],
        "padded_first": acc.pad_across_processes(torch.ones(r + 1), pad_index=-1, pad_first=True).tolist(),
        "broadcast": acc.broadcast(torch.tensor([r * 5])).item(),
        "object": acc.broadcast_object_list([{"from": r}])[0],
    }
    with acc.split_between_processes(list(range(5))) as part:
        out["split"] = part
    with acc.split_between_processes(list(range(5)), apply_padding=True) as part:
        out["split_padded"] = part
    order = []
    with acc.main_process_first():
        order.append(r)
    out["decorated"] = acc.on_main_process(lambda: "ran")()
    out["on_process_1"] = acc.on_process(lambda: "ran", process_index=1)()
    acc.wait_for_everyone()
    return out


def test_state_and_collectives_on_two_cpu_ranks():
    r0, r1 = run_on_ranks(_state_and_collectives, 2)
    for r in (r0, r1):
        assert r["backend"] == "gloo" and r["type"] == "MULTI_CPU" and r["n"] == 2
        assert r["gather"] == [0, 10, 1, 11]
        assert r["gather_scalar"] == [0.0, 1.0]
        assert r["sum"] == 3.0 and r["mean"] == 1.5
        assert r["padded"] == 2
        assert r["broadcast"] == 0
        assert r["object"] == {"from": 0}
    assert (r0["main"], r1["main"], r0["last"], r1["last"]) == (True, False, False, True)
    assert r0["padded_first"] == [-1, 1] and r1["padded_first"] == [1, 1]
    assert r0["split"] == [0, 1, 2] and r1["split"] == [3, 4]
    assert r0["split_padded"] == [0, 1, 2] and r1["split_padded"] == [3, 4, 4]
    assert (r0["decorated"], r1["decorated"]) == ("ran", None)
    assert (r0["on_process_1"], r1["on_process_1"]) == (None, "ran")


def _epoch_orders():
    from impel import Accelerator, set_seed

    set_seed(1234, device_specific=True)  # ranks seed differently; the data order must still agree
    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(IndexDataset(24), batch_size=3, shuffle=True))
    epochs = []
    for _ in range(3):
        epochs.append(torch.cat([b.flatten() for b in loader]).tolist())
    return acc.gather_for_metrics(torch.tensor(epochs[0])).tolist(), epochs


def test_shuffles_agree_across_ranks_and_differ_per_epoch():
    (all0, e0), (all1, e1) = run_on_ranks(_epoch_orders, 2)
    for epoch in range(3):
        assert set(e0[epoch]).isdisjoint(e1[epoch])
        assert sorted(e0[epoch] + e1[epoch]) == list(range(24))
    assert e0[0] != e0[1] != e0[2]
    # gather_for_metrics: every rank gets rank 0's samples then rank 1's, each sample once
    assert all0 == all1 == e0[0] + e1[0]


def _mismatched_gather():
    from impel import Accelerator

    acc = Accelerator(cpu=True)
    return acc.gather(torch.zeros(acc.process_index + 1))


def test_gather_with_different_shapes_raises_instead_of_hanging():
    with pytest.raises(RankFailed, match="pad_across_processes"):
        run_on_ranks(_mismatched_gather, 2, timeout=60)


def _train_mixed(precision: str):
    from torch import nn

    from helpers import make_mlp, make_regression
    from impel import Accelerator, GradScalerKwargs

    # a small initial scale: the default 2**16 overflows fp16 on the first steps, which GradScaler skips
    handlers = [GradScalerKwargs(init_scale=2.0**10)] if precision == "fp16" else []
    acc = Accelerator(cpu=True, mixed_precision=precision, kwargs_handlers=handlers)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    loader = DataLoader(make_regression(64), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, dtypes = [], set()
    hook = acc.unwrap_model(model)[0].register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    skipped = 0
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        skipped += acc.optimizer_step_was_skipped
        opt.zero_grad()
        losses.append(loss.item())
    hook.remove()
    assert skipped == 0
    return losses, dtypes, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_under_ddp_and_tracks_fp32(precision):
    refs = run_on_ranks(_train_mixed, 2, args=("no",), timeout=120)  # both jobs within pytest-timeout's 300 s
    results = run_on_ranks(_train_mixed, 2, args=(precision,), timeout=120)
    want = torch.bfloat16 if precision == "bf16" else torch.float16
    for (losses, dtypes, _), (ref_losses, ref_dtypes, _) in zip(results, refs):
        assert ref_dtypes == {torch.float32}
        assert dtypes == {want}
        # half-precision matmuls (8 / 11 mantissa bits): every step's loss stays within 2% of fp32's
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 0.02
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))


def _barrier_with_missing_peer():
    import torch.distributed as dist

    from impel import Accelerator, InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=97))])
    configured = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout  # what gloo was built with
    store = dist.distributed_c10d._get_default_store()
    if acc.process_index == 1:
        store.wait(["rank0_done"], timedelta(seconds=60))  # never reaches the barrier while rank 0 waits in it
        return configured, "stayed away"
    # Only the one collective that must time out gets a short limit; the job ran under the configured 97 s.
    dist.group.WORLD.set_timeout(timedelta(seconds=3))
    try:
        acc.wait_for_everyone()
        outcome = "passed"
    except RuntimeError as exc:
        outcome = f"raised: {exc}"
    store.set("rank0_done", "1")
    return configured, outcome


def test_process_group_timeout_is_configurable():
    (configured0, r0), (configured1, r1) = run_on_ranks(_barrier_with_missing_peer, 2, timeout=60)
    assert configured0 == configured1 == timedelta(seconds=97)  # InitProcessGroupKwargs reached the gloo group
    assert r0.startswith("raised") and "timed out" in r0.lower() and r1 == "stayed away"  # a timeout, not a hang


def _trackers(project_dir: str):
    from impel import Accelerator

    acc = Accelerator(log_with="jsonl", project_dir=project_dir)
    acc.init_trackers("run")
    acc.log({"rank": acc.process_index}, step=1)
    count = len(acc.trackers)
    acc.end_training()
    return count


def test_trackers_live_on_the_main_process_only(tmp_path):
    counts = run_on_ranks(_trackers, 2, args=(str(tmp_path),))
    assert counts == [1, 0]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() == ['{"step": 1, "rank": 0}']


def _second_accelerator_with_other_group_settings():
    from impel import Accelerator, ConfigError, InitProcessGroupKwargs

    Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=97))])
    Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=97))])  # the same: fine
    Accelerator(cpu=True)  # nothing asked: the live group serves
    try:
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=30))])
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_a_second_accelerator_cannot_silently_change_the_process_group():
    for message in run_on_ranks(_second_accelerator_with_other_group_settings, 2, timeout=60):
        assert "InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=30))" in message
        assert "timeout=datetime.timedelta(seconds=97)" in message and "pass the same value" in message
