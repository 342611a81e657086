"""Small models and data shared by the tests (importable by spawned ranks)."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


def make_regression(n: int = 80, dim: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_mlp(dim: int = 6, hidden: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class IndexDataset(Dataset):
    """Sample i is the tensor [i]: makes sharding visible."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def reference_train(model: nn.Module, dataset, batch_size: int, steps: int, lr: float = 0.05,
                    accumulation: int = 1, optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """A hand-written single-process loop: the ground truth every distributed run is compared with."""
    opt = make_optimizer(model, optimizer, lr)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    it = iter(loader)
    for _ in range(steps):
        for _ in range(accumulation):
            x, y = next(it)
            loss = nn.functional.mse_loss(model(x), y) / accumulation
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_optimizer(model: nn.Module, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
