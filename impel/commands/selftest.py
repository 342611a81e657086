"""impel's built-in check, run by ``impel test`` on every rank of the configured job.

Three checks, each against a value every rank can compute alone: collectives (gather, reduce, broadcast),
data sharding (every sample seen exactly once per epoch across ranks), and training equivalence (a small
model trained through the Accelerator under the current config ends where a single-process loop over the same
global batches ends). Prints PASS/FAIL per check on the main process; exits 0 only when all pass on all ranks.
"""
from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from impel.accelerator.facade import Accelerator
from impel.runtime.ranks.collectives import broadcast_object_list, gather, gather_object, reduce

STEPS, PER_RANK_BATCH, LR = 6, 4, 0.1


def check_collectives(acc: Accelerator) -> str:
    world, rank = acc.num_processes, acc.process_index
    ranks = gather(torch.tensor([rank], device=acc.device)).cpu().tolist()
    assert ranks == list(range(world)), f"gather gave {ranks}, expected {list(range(world))}"
    total = reduce(torch.tensor(float(rank + 1), device=acc.device), reduction="sum").item()
    assert total == world * (world + 1) / 2, f"reduce(sum) gave {total}"
    token = [f"from-rank-0-{world}" if rank == 0 else None]
    assert broadcast_object_list(token)[0] == f"from-rank-0-{world}", "broadcast_object_list lost rank 0's object"
    return f"gather/reduce/broadcast agree on {world} rank(s)"


def check_sharding(acc: Accelerator) -> str:
    n = 4 * acc.num_processes + 3  # not a multiple of the global batch: the last batch is short
    loader = acc.prepare_data_loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=2, shuffle=True))
    seen: list[int] = []
    batches = 0
    for (batch,) in loader:
        seen += gather_for_metrics_list(acc, batch)
        batches += 1
    counts = gather_object([batches])
    assert len(set(counts)) == 1, f"ranks saw different numbers of batches: {counts}"
    assert sorted(seen) == list(range(n)), f"samples seen across ranks {sorted(seen)} != 0..{n - 1}"
    return f"{n} samples seen exactly once over {acc.num_processes} rank(s) in {batches} batches each"


def gather_for_metrics_list(acc: Accelerator, batch: torch.Tensor) -> list[int]:
    return acc.gather_for_metrics(batch.to(acc.device)).cpu().tolist()


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def check_training(acc: Accelerator) -> str:
    accum = acc.gradient_accumulation_steps
    global_batch = PER_RANK_BATCH * acc.num_processes
    data = _data(global_batch * accum * STEPS)
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for x, y in DataLoader(data, batch_size=global_batch * accum):
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = _model()
    model, optim, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR),
                                       DataLoader(data, batch_size=PER_RANK_BATCH))
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            optim.step()
            optim.zero_grad()
    trained = acc.get_state_dict(model)
    if not trained and not acc.is_main_process:
        return "weights are gathered on the main process only here (ZeRO-3); it compared them"
    tol = 1e-5 if acc.mixed_precision == "no" else 5e-2
    worst = max((trained[k].float().cpu() - v).abs().max().item() for k, v in reference.state_dict().items())
    assert worst <= tol, f"parameters differ from the single-process reference by {worst:.2e} (> {tol:g})"
    return f"{STEPS} steps (accumulation {accum}, {acc.mixed_precision}) match the reference within {worst:.1e}"


CHECKS: dict[str, Callable[[Accelerator], str]] = {
    "collectives": check_collectives, "data sharding": check_sharding, "training equivalence": check_training}


def _accelerator() -> Accelerator:
    """Under ZeRO-3 the check needs gathered weights: ask for them unless the launch already said."""
    from impel.config.environment_settings import launched_settings

    launched = launched_settings() or {}
    ds = launched.get("deepspeed_config") or {}
    if launched.get("distributed_type") == "DEEPSPEED" and ds.get("zero_stage") == 3 \
            and ds.get("zero3_save_16bit_model") is None:
        from impel.config.plugins import DeepSpeedPlugin

        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero3_save_16bit_model=True))
    return Accelerator()


def main() -> int:
    acc = _accelerator()
    results: list[tuple[str, bool, str]] = []
    for name, check in CHECKS.items():
        try:
            results.append((name, True, check(acc)))
        except Exception as exc:  # noqa: BLE001 - a failed check is reported, not raised
            detail = str(exc) if isinstance(exc, AssertionError) else traceback.format_exc(limit=3)
            results.append((name, False, detail))
    everyone = gather_object([results])
    ok = all(passed for rank_results in everyone for _, passed, _ in rank_results)
    if acc.is_main_process:
        print(f"impel test: {acc.num_processes} rank(s), {acc.distributed_type}, device {acc.device.type}, "
              f"mixed_precision={acc.mixed_precision}")
        for rank, rank_results in enumerate(everyone):
            for name, passed, detail in rank_results:
                if rank == 0 or not passed:
                    print(f"  {'PASS' if passed else 'FAIL'} [rank {rank}] {name}: {detail}")
        print("impel test: " + ("PASS" if ok else "FAIL"))
    acc.end_training()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
