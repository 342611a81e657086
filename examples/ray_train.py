"""Ray Train running an impel training loop: `python examples/ray_train.py` (2 CPU workers on this machine).

Ray Train starts the workers, creates their process group and sets `ACCELERATE_TORCH_DEVICE`; impel's Accelerator
adopts both, so the loop is the same one `impel launch` or `mpiexec` run. Each worker prints its rank, the world
size and how far its final weights are from one process trained on the same global batches.
On a Ray cluster, pass `--address auto` and `--workers N` (and `--gpu` for one GPU per worker).
"""
import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 1))


def dataset(world: int, steps: int) -> TensorDataset:
    x = torch.randn(8 * world * steps, 5, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def train_loop(config: dict) -> None:
    """The worker's loop: impel's Accelerator inside the process group Ray Train made."""
    from impel import Accelerator

    acc = Accelerator()
    data = dataset(acc.num_processes, config["steps"])
    reference = build()  # one process over the same global batches, for the printed difference
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for bx, by in DataLoader(data, batch_size=8 * acc.num_processes):
        nn.functional.mse_loss(reference(bx), by).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = build()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8))
    for bx, by in loader:
        acc.backward(nn.functional.mse_loss(model(bx), by))
        opt.step()
        opt.zero_grad()
    final = acc.get_state_dict(model)
    diff = max((final[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    print("REPORT " + json.dumps({"rank": acc.process_index, "world": acc.num_processes, "diff": diff,
                                  "device": str(acc.device)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="a Ray cluster's address (default: start one here)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    args = parser.parse_args()

    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=args.address, num_cpus=None if args.address else args.workers, include_dashboard=False)
    TorchTrainer(train_loop, train_loop_config={"steps": args.steps},
                 scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu)).fit()


if __name__ == "__main__":
    main()
