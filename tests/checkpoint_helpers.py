"""Training runs for the checkpoint tests (importable by spawned ranks).

The run has everything an exact resume must restore: dropout (RNG), a shuffled loader whose epochs do not divide
into accumulation groups (44 samples, global batch 4: 11 batches, groups 2,2,2,2,2,1), AdamW with weight decay,
and a warm-up scheduler. 20 optimizer steps cross three epoch boundaries; a save at step 10 lands mid-epoch.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_regression

GLOBAL_BATCH = 4


def make_run(project_dir: str | None, seed: int = 0, total_limit: int | None = None, accumulation: int = 2,
             **accelerator_kwargs: Any) -> tuple[Any, ...]:
    """A prepared (accelerator, model, optimizer, loader, scheduler); ``seed`` seeds init and shuffling."""
    from impel import Accelerator, ProjectConfiguration, set_seed

    config = None
    if project_dir is not None:
        config = ProjectConfiguration(project_dir, automatic_checkpoint_naming=True, total_limit=total_limit)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, project_config=config,
                      **accelerator_kwargs)
    set_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loader = DataLoader(make_regression(44), batch_size=GLOBAL_BATCH // acc.num_processes, shuffle=True)
    return (acc, *acc.prepare(model, opt, loader, sched))


def train(acc: Any, model: Any, opt: Any, loader: Any, sched: Any, until: int, save_at: Sequence[int] = ()) -> None:
    """Train until ``until`` optimizer steps in total (continuing mid-epoch after a resume); save at ``save_at``."""
    while opt.steps_taken < until:
        for x, y in loader:
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            if acc.sync_gradients and opt.steps_taken in save_at:
                acc.save_state()
            if acc.sync_gradients and opt.steps_taken >= until:
                break


def snapshot(acc: Any, model: Any, opt: Any, sched: Any) -> dict[str, Any]:
    """Parameters, optimizer state, learning rate and the next random draw: all must match bitwise."""
    inner = acc.unwrap_model(model)
    return {"params": {k: v.detach().clone() for k, v in inner.state_dict().items()},
            "exp_avg": [opt.state[p]["exp_avg"].clone() for p in inner.parameters()],
            "lr": sched.get_last_lr(), "steps": opt.steps_taken, "next_random": torch.rand(3)}


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
    for x, y in zip(a["exp_avg"], b["exp_avg"]):
        assert torch.equal(x, y)
    assert a["lr"] == b["lr"] and a["steps"] == b["steps"]
    assert torch.equal(a["next_random"], b["next_random"])


def uninterrupted(steps: int) -> dict[str, Any]:
    acc, model, opt, loader, sched = make_run(None)
    train(acc, model, opt, loader, sched, steps)
    return snapshot(acc, model, opt, sched)


def first_half(project_dir: str, steps: int, save_at: Sequence[int], total_limit: int | None = None) -> list[str]:
    acc, model, opt, loader, sched = make_run(project_dir, total_limit=total_limit)
    train(acc, model, opt, loader, sched, steps, save_at)
    return _listing(project_dir)


def resumed(project_dir: str, steps: int, save_at: Sequence[int] = (),
            total_limit: int | None = None) -> dict[str, Any]:
    # a different seed: model init, shuffle seed and RNG streams all differ until load_state restores them
    acc, model, opt, loader, sched = make_run(project_dir, seed=1234, total_limit=total_limit)
    loaded = acc.load_state()
    iteration = acc.save_iteration
    train(acc, model, opt, loader, sched, steps, save_at)
    return dict(snapshot(acc, model, opt, sched), loaded=loaded, iteration=iteration, listing=_listing(project_dir))


def _listing(project_dir: str) -> list[str]:
    import os

    return sorted(os.listdir(os.path.join(project_dir, "checkpoints")))


def masking_run(directory: str, mode: str, seedable: bool = True, stop: int = 3,
                total: int = 7) -> tuple[list[Any], list[Any]]:
    """A loop whose collator masks at random from torch's global RNG (as transformers' masked-LM collator) and whose
    model draws dropout masks, ``total`` batches per rank: ``full`` saves after step ``stop`` and goes on; ``skip`` /
    ``position`` resume from that save through ``skip_first_batches`` (the no_trainer scripts' way) or the loader's
    own restored position. Returns the batches seen and the final weights (as lists: comparable across processes).
    Each rank seeds its own stream after ``prepare``, so ranks draw different masks."""
    from impel import Accelerator, DataLoaderConfiguration

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))

    def collate(items: list[int]) -> torch.Tensor:
        x = torch.tensor([[float(i + j) for j in range(8)] for i in items]) / 20
        return x * (torch.rand_like(x) > 0.3)  # 16 draws a batch: an equal mask by chance is ~1e-4

    model = nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.3), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = list(range(total * 2 * acc.num_processes))
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate))
    torch.manual_seed(100 + acc.process_index)
    batches, start = loader, 0
    if mode != "full":
        acc.load_state(f"{directory}/ckpt")
        start = stop
        batches = acc.skip_first_batches(loader, stop) if mode == "skip" else loader
    seen = []
    for step, x in enumerate(batches, start=start):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        seen.append(x.tolist())
        if mode == "full" and step + 1 == stop:
            acc.save_state(f"{directory}/ckpt")
    return seen, [p.detach().tolist() for p in model.parameters()]


def prepared_mlp(project_dir: Any = None, total_limit: int | None = None, steps: int = 0,
                 **config: Any) -> tuple[Any, Any, Any]:
    """An Accelerator (CPU; automatic checkpoint naming when ``project_dir`` is given) with a prepared MLP and SGD with
    momentum, after ``steps`` optimizer steps (so the optimizer has state to save)."""
    from helpers import make_mlp
    from impel import Accelerator, ProjectConfiguration

    pc = ProjectConfiguration(project_dir, automatic_checkpoint_naming=project_dir is not None,
                              total_limit=total_limit, **config)
    acc = Accelerator(cpu=True, project_config=pc)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
    return acc, model, opt
