"""The worker's part of a full fine-tune's reference pass (data/preference/reference.py): the starting
model's log-probabilities of a chunk's items, this rank's share of them, before the first update.

Data-parallel replica d of D takes the chunk's items d, d + D, ... (the ranks of a tensor-parallel
replica the same ones, as in training); every rank runs the same number of forwards (ZeRO-3 gathers
parameters collectively), repeating its last item where its share is shorter. Forwards run
without gradients and without dropout, micro_batch_size items (2 rows each) at a time.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from elastictrain.data.preference.reference import ReferenceTable, load_table

if TYPE_CHECKING:  # the actor module is imported on the driver, which must not import torch for it
    from elastictrain.data.preference.dataset import PreferenceRows


def rows_digest(rows: PreferenceRows) -> str:
    """sha256 of every item's token ids (and KTO label): what a reference table was computed for."""
    h = hashlib.sha256()
    for i in range(len(rows)):
        prompt, first, second = rows.rows(i)
        h.update(np.asarray([len(prompt), len(first), len(second)], dtype=np.int64).tobytes())
        h.update(np.asarray(prompt + first + second, dtype=np.int64).tobytes())
    return f"{len(rows)}-{h.hexdigest()[:16]}"


class ReferenceShare:
    engine: Any
    dataset: Any
    collate: Any
    spec: Any
    loss_fn: Any

    def _rows(self) -> PreferenceRows:
        from elastictrain.data.preference.dataset import base_rows

        rows = base_rows(self.dataset)
        if rows is None:
            raise RuntimeError("the reference pass needs preference data (training.objective dpo or kto)")
        return rows

    def reference_items(self) -> dict[str, Any]:
        """How many items the reference covers (the whole dataset, validation split included)."""
        rows = self._rows()
        return {"items": len(rows), "data_digest": rows_digest(rows)}

    def reference_logps(self, start: int, stop: int) -> dict[str, Any]:
        """This rank's share of items [start, stop): their indices and [k, 2] log-probabilities."""
        import torch

        from elastictrain.data.sources import to_device
        from elastictrain.model.objective import PreferenceObjective

        assert self.spec is not None and self.engine is not None, "reference_logps before setup"
        self._maybe_fault(start, "reference")  # type: ignore[attr-defined]  # a fault point (tests, chaos)
        objective = self.loss_fn  # the attempt's (model/build.py loss_function)
        assert isinstance(objective, PreferenceObjective)
        rows = self._rows()
        plan, rank = self.spec.plan, self.spec.rank
        replicas = plan.data_parallel
        mine = list(range(start + plan.data_rank(rank), stop, replicas))
        per_forward = plan.micro_batch_size
        longest = -(-len(range(start, stop, replicas)) // per_forward)  # replica 0 has the most items
        values: list[list[float]] = []
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for f in range(longest):
                    part = mine[f * per_forward : (f + 1) * per_forward] or mine[-1:] or [start]
                    batch = to_device(rows.collate([rows[i] for i in part]), self.engine.device)
                    n = len(part)
                    logps, _ = objective.policy_logps(self.engine, batch, slice(0, 2 * n))
                    pairs = torch.stack([logps[:n], logps[n:]], dim=1).float().cpu().tolist()
                    values.extend(pairs[: max(0, len(mine) - f * per_forward)])
        finally:
            module.train(was_training)
        return {"rank": rank, "indices": mine, "logps": values[: len(mine)]}

    def use_reference(self, table: ReferenceTable | None) -> None:
        """Attach the run's reference table to the data (checked against its sha256 once per table)."""
        if table is None:
            return
        rows = self._rows()
        if rows.reference_sha256 == table.sha256:
            return
        import torch

        rows.reference = torch.from_numpy(load_table(table).copy())
        rows.reference_sha256 = table.sha256
