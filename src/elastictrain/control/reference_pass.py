"""A full fine-tune's reference pass, driven by the controller before the first step (DPO, KTO with
`preference.reference: precomputed`).

The attempt's workers hold the starting model; chunk by chunk they compute its log-probabilities of
every item (worker/reference_share.py) and the driver writes each chunk into RUN_DIR/reference/ as it
completes. A failure mid-pass restarts the attempt as any failure does, and the pass goes on from the
chunks written; once whole, the table is what every later attempt loads (AttemptSpec.reference).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from elastictrain.cluster.calls import Group
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.errors import RunFailed
from elastictrain.control.failures import gather_results
from elastictrain.control.record import RunRecorder
from elastictrain.core.objectives import run_reference
from elastictrain.data.preference import reference as store
from elastictrain.data.preference.reference import ReferenceError, ReferenceTable


class ReferencePass:
    def __init__(self, config: Any, group: Group, recorder: RunRecorder) -> None:
        self.cfg = config
        self.group = group
        self.recorder = recorder
        self.folder = recorder.run_dir.path / "reference"
        self.wanted = run_reference(config) == "precomputed"
        self.table: ReferenceTable | None = None
        self.chunk_items = store.CHUNK_ITEMS  # items per chunk: what a failure mid-pass can cost again
        if self.wanted:  # a run resumed after its pass: the table is known before any worker asks
            manifest = store.read_manifest(self.folder)
            if manifest is not None:
                self.table = ReferenceTable(str(self.folder), int(manifest["items"]), str(manifest["sha256"]))

    def due(self) -> bool:
        return self.wanted and self.table is None

    def run(self, active: Sequence[Any], step: int) -> None:
        """Compute what is missing of the table on the attempt's workers (holding the starting model)."""
        if step != 0:
            raise RunFailed(
                f"the reference log-probabilities ({self.folder}/{store.MANIFEST}) are missing, and this run "
                f"is at step {step}: they are the starting model's, which a run past step 0 no longer holds. "
                "Restore the reference folder, or start the run again (--fresh)"
            )
        timeout = self.cfg.failure.collective_timeout_s
        (first,) = gather_results(
            self.group,
            self.group.call(active[:1], WorkerApi.reference_items),
            step,
            timeout_s=timeout,
            phase="reference",
        ).values()
        items, digest = int(first["items"]), str(first["data_digest"])
        try:
            found = store.complete(self.folder, items, digest)
        except ReferenceError as e:
            raise RunFailed(str(e)) from None
        if found is None:
            found = self._compute(active, step, items, digest)
        self.table = found
        gather_results(
            self.group,
            self.group.call(active, WorkerApi.use_reference, found),
            step,
            timeout_s=timeout,
            phase="reference",
        )

    def _compute(self, active: Sequence[Any], step: int, items: int, digest: str) -> ReferenceTable:
        done = store.done_chunks(self.folder, items, self.chunk_items)
        todo = [c for c in store.chunks(items, self.chunk_items) if c not in done]
        t0, computed = time.perf_counter(), 0
        self.recorder.event(
            "reference_pass",
            f"reference pass: the starting model's log-probabilities of {items} items, "
            f"{len(todo)} of {len(done) + len(todo)} chunks to compute"
            + (f" ({len(done)} written before)" if done else ""),
            step=step,
            items=items,
            chunks_done=len(done),
            chunks_todo=len(todo),
        )
        for start, stop in todo:
            calls = self.group.call(active, WorkerApi.reference_logps, start, stop)
            shares = gather_results(
                self.group, calls, step, timeout_s=self.cfg.failure.hang_timeout_s, phase="reference"
            )
            values = np.full((stop - start, 2), np.nan, dtype=np.float32)
            for share in shares.values():
                for i, pair in zip(share["indices"], share["logps"], strict=True):
                    values[i - start] = pair
            store.write_chunk(self.folder, start, values)
            computed += stop - start
            rate = computed / max(time.perf_counter() - t0, 1e-9)
            self.recorder.reporter.event(f"reference pass: {stop}/{items} items ({rate:.1f}/s)")
        table = store.finish(self.folder, items, digest, self.chunk_items)
        elapsed = time.perf_counter() - t0
        self.recorder.event(
            "reference_done",
            f"reference pass: {items} items in {elapsed:.1f}s; kept in {self.folder} "
            f"(sha256 {table.sha256[:12]})",
            step=step,
            items=items,
            seconds=elapsed,
            sha256=table.sha256,
        )
        return table
