"""Preference data as a map-style dataset whose every item is two rows: a pair's chosen and rejected
answers, or a KTO record's answer and its mismatched answer (the KL estimate's row).

A KTO record's mismatched row is its prompt followed by the answer of the next record (index i + 1,
wrapping): a pairing fixed by the data, not by the order a step reads it, so the reference pass can
compute its log-probability once (TRL pairs within a shuffled batch: the same estimate in expectation).

A micro-batch of B items is 2B rows: every item's first row, then every item's second, right-padded to
the longest, labels -100 outside the answers. The reference's log-probabilities of both rows (where a
run keeps them, data/preference/reference.py) travel with each item, so views and splits carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elastictrain.data.preference.build import PreferenceReport, build_kto, build_pairs
from elastictrain.data.preference.encode import EncodedKto, EncodedPair
from elastictrain.model.loss import IGNORE_INDEX


class PreferenceRows:
    """Items of two rows each; `reference` ([len, 2] float32, or None) is attached by the worker."""

    def __init__(
        self,
        items: Sequence[EncodedPair | EncodedKto],
        report: PreferenceReport,
        pad_token_id: int,
        *,
        kto: bool,
    ) -> None:
        self.items = list(items)
        self.report = report
        self.pad_token_id = pad_token_id
        self.kto = kto
        self.reference: torch.Tensor | None = None
        self.reference_sha256: str | None = None  # of the table `reference` was loaded from

    def __len__(self) -> int:
        return len(self.items)

    def rows(self, index: int) -> tuple[list[int], list[int], list[int]]:
        """(prompt, first answer, second answer) token ids of item `index`."""
        item = self.items[index]
        if isinstance(item, EncodedPair):
            return item.prompt_ids, item.chosen_ids, item.rejected_ids
        partner = self.items[(index + 1) % len(self.items)]
        assert isinstance(partner, EncodedKto)
        return item.prompt_ids, item.answer_ids, partner.answer_ids

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        prompt, first, second = self.rows(index)
        out: dict[str, Any] = {"prompt": prompt, "first": first, "second": second, "index": index}
        item = self.items[index]
        if isinstance(item, EncodedKto):
            out["desirable"] = item.desirable
        if self.reference is not None:
            out["reference"] = self.reference[index]
        return out

    def origin(self, index: int) -> str:
        file, record = self.report.origins[index]
        return f"{file} record {record}"

    def collate(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_rows(items, self.pad_token_id)


def collate_rows(items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """2B right-padded rows (every item's first row, then every second row), labels on answers only."""
    rows = [(it["prompt"], it["first"]) for it in items] + [(it["prompt"], it["second"]) for it in items]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (prompt, answer) in enumerate(rows):
        n, k = len(prompt) + len(answer), len(prompt)
        ids[r, :n] = torch.tensor(prompt + answer, dtype=torch.long)
        labels[r, k:n] = ids[r, k:n]
        mask[r, :n] = 1
    out = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long),
    }
    if "desirable" in items[0]:
        out["desirable"] = torch.tensor([bool(it["desirable"]) for it in items])
    if all("reference" in it for it in items):
        out["reference"] = torch.stack([torch.as_tensor(it["reference"]) for it in items]).float()
    return out


def build_preference_dataset(data: Any, pretrained: str | None, objective: str) -> PreferenceRows:
    """The pairs (or KTO records, objective kto) of `data`, encoded and cut as the builder does."""
    kto = objective == "kto"
    items, report = (build_kto if kto else build_pairs)(data, pretrained)
    return PreferenceRows(items, report, report.pad_token_id, kto=kto)


def base_rows(dataset: Any) -> PreferenceRows | None:
    """The PreferenceRows under views (eval splits), or None for other datasets."""
    for _ in range(8):
        if isinstance(dataset, PreferenceRows) or dataset is None:
            return dataset
        dataset = getattr(dataset, "dataset", None)
    return None
