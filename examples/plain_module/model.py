"""A plain torch.nn.Module on a synthetic dataset: the smallest "bring your own code" example.

Nothing here knows about elastictrain. Factories take the run's config (to read `model.args` and
`data.args`); the loss takes (model, batch) and returns a scalar tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x)).squeeze(-1)


class SyntheticRegression:
    """A map-style dataset: item i is a fixed (x, y) pair, y a smooth function of x plus a little noise.

    Each item is generated from its own index, so the dataset needs no storage and any worker builds
    exactly the same one.
    """

    def __init__(self, size: int, dim: int, seed: int = 0) -> None:
        self.size, self.dim, self.seed = size, dim, seed
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(dim, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = torch.randn(self.dim, generator=g)
        y = torch.tanh(2 * (x @ self.w) / self.dim**0.5) + 0.05 * torch.randn((), generator=g)
        return {"x": x, "y": y}


def build_model(config: Any) -> nn.Module:
    args = config.model.args
    return MLP(dim=int(args.get("dim", 8)), hidden=int(args.get("hidden", 32)))


def build_dataset(config: Any) -> SyntheticRegression:
    args = config.data.args
    return SyntheticRegression(size=int(args.get("size", 512)), dim=int(args.get("dim", 8)), seed=1)


def mse_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])
