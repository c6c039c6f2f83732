"""Tensor-parallel slices in checkpoints: how a slice is named, and how one layout's slices make another's.

Under tensor parallelism of degree N a sliced parameter (an attention or MLP projection) is held as N
slices along one dimension, rank t of each replica holding slice t. Its fragments are saved under the
name `<parameter>#tp<t>of<N>d<dim>` (the fragment's shape is the slice's), parameters every rank holds
whole (norms, embeddings) under their own name. A loader at any layout reads a parameter as a whole
(the N slices joined along their dimension) and cuts its own slice: a checkpoint at (TP a, DP b) loads at
(TP c, DP d), TP 1 included, and an export reads whole parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

_QUALIFIED = re.compile(r"^(?P<name>.+)#tp(?P<index>\d+)of(?P<count>\d+)d(?P<dim>\d+)$")


@dataclass(frozen=True)
class TensorSlice:
    """Slice `index` of `count` along dimension `dim` of a parameter."""

    dim: int
    index: int
    count: int

    def qualify(self, name: str) -> str:
        return f"{name}#tp{self.index}of{self.count}d{self.dim}"

    def cut(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """This slice of the whole parameter (even slices, as DeepSpeed makes them where they divide)."""
        size = whole.shape[self.dim]
        if size % self.count:
            raise ValueError(
                f"{name}: dimension {self.dim} of {size} does not split into {self.count} even slices"
            )
        step = size // self.count
        return whole.narrow(self.dim, self.index * step, step)


def parse(qualified: str) -> tuple[str, TensorSlice | None]:
    """(parameter name, its slice) from a saved name; no slice for a parameter saved whole."""
    m = _QUALIFIED.match(qualified)
    if m is None:
        return qualified, None
    return m["name"], TensorSlice(int(m["dim"]), int(m["index"]), int(m["count"]))


def join(slices: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole parameter from its slices in index order."""
    return torch.cat(slices, dim=dim) if len(slices) > 1 else slices[0]


def saved_names(engine: Any) -> dict[Any, str]:
    """Each parameter's name in checkpoints: its module path, with its slice where AutoTP sliced it."""
    from elastictrain.compat.deepspeed.autotp import engine_tensor_slices

    slices = {param: TensorSlice(*s) for param, s in engine_tensor_slices(engine).items()}
    # Pipeline stages (model/pipeline.py) know each parameter's transformers name.
    renamed = getattr(engine.module, "transformers_names", {})
    return {
        param: slices[param].qualify(name) if param in slices else renamed.get(name, name)
        for name, param in engine.module.named_parameters()
    }
