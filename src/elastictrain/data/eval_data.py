"""The training and validation datasets of a run: a held-out split of the data, or eval.data's own."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from elastictrain.core.data_order import held_out


class IndexView:
    """A map-style view of some of a dataset's samples; `source_index` names the sample in the dataset."""

    def __init__(self, dataset: Any, indices: tuple[int, ...]) -> None:
        self.dataset = dataset
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]

    def source_index(self, i: int) -> int:
        return self.indices[i]


def source_ids(dataset: Any, indices: list[int]) -> list[int]:
    """The dataset's own indices of what a view read (what the sample ledger records)."""
    if isinstance(dataset, IndexView):
        return [dataset.source_index(i) for i in indices]
    return list(indices)


def train_and_eval_datasets(config: Any) -> tuple[Any, Any | None]:
    """(what training reads, the validation set or None)."""
    from elastictrain.data.sources import dataset_from_config

    dataset = dataset_from_config(config)
    e = config.eval
    if e.data is not None:
        return dataset, dataset_from_config(replace(config, data=e.data))
    if e.split > 0:
        train, held = held_out(len(dataset), e.split, config.training.seed)
        return IndexView(dataset, train), IndexView(dataset, held)
    return dataset, None
