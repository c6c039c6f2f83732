"""The actor methods that run a step: training steps (or a skipped batch) and validations.

A mixin of the worker (worker/actor.py): it reads the attempt's spec, engine, data and in-memory
snapshots the worker keeps, and reports what the driver's loop applies (control/loop.py).
"""

from __future__ import annotations

import time
import traceback
from typing import TYPE_CHECKING, Any

from elastictrain.compat.deepspeed.skip_update import update_applied
from elastictrain.core.data_order import derive_seed, micro_batch_positions, sample_at
from elastictrain.core.schedule import step_learning_rate
from elastictrain.host.memory import memory_peaks
from elastictrain.worker.dist import zero_stage


class StepFailed(RuntimeError):
    """A training step raised on this rank; the message holds the original error and traceback."""


class StepRunner:
    spec: Any
    engine: Any
    dataset: Any
    eval_dataset: Any
    collate: Any
    loss_fn: Any
    prompts: Any
    memory: Any
    _writer: Any
    _idle_since: float

    if TYPE_CHECKING:  # the worker's own

        def _set_mark(self, phase: str, step: int) -> None: ...
        def _maybe_fault(self, step: int, phase: str = "start") -> None: ...
        def _arm_backward_fault(self, step: int) -> None: ...
        def _abandon_attempt(self) -> None: ...

    def train_step(
        self, step: int, snapshot: bool | None = None, probe: bool = False, skip: bool = False
    ) -> dict[str, Any]:
        """One optimizer step: `grad_accum_steps` micro-batches of this rank's share of the global batch;
        then, if `snapshot` (the controller's mark), the in-memory snapshot of the state after it (with
        `probe`, copied only at the next step's update: `WorkerMemory.after_step`). `skip`: the batch is
        skipped on purpose (a rollback's): nothing runs, the state stays."""
        assert self.spec is not None and self.engine is not None, "train_step before setup"
        waited = time.time() - self._idle_since
        try:
            result = self._skipped_step(step) if skip else self._train_step(step)
            result["waited_s"] = waited  # idle before this step: after a save, part of its pause
            result["update_wait_s"] = self.memory.pop_update_wait()  # for a copy: after a save, too
            result["memory"] = self.memory.report()
            # A state a step did not change is not copied again: the snapshot before a run of bad steps
            # stays held (a worker keeps two), for a rollback to it.
            due = snapshot if result["update_applied"] else False
            self.memory.after_step(self.engine, step + 1, due, probe=probe)
            self._idle_since = time.time()
            return result
        except Exception as e:  # noqa: BLE001 - re-raised below, after the attempt is released
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        # Outside the except block, so the traceback's frames no longer hold the engine: dropping it and
        # the process group closes this rank's connections, and peers waiting for it in a collective fail
        # now instead of after the collective timeout.
        self._abandon_attempt()
        raise StepFailed(error)

    def _micro_reads(self, step: int) -> list[tuple[range, list[int]]]:
        """Each micro-batch of this rank at step `step`: its global positions and the dataset indices read."""
        assert self.spec is not None
        n, seed = len(self.dataset), self.spec.config.training.seed
        reads = []
        for micro in range(self.spec.plan.grad_accum_steps):
            positions = micro_batch_positions(step, self.spec.plan, self.spec.rank, micro)
            reads.append((positions, [sample_at(p, n, seed) for p in positions]))
        return reads

    def _sample_ids(self, step: int) -> list[int]:
        """The ids of this rank's samples of step `step`, in the order its micro-batches read them."""
        from elastictrain.data.eval_data import source_ids

        return [i for _, indices in self._micro_reads(step) for i in source_ids(self.dataset, indices)]

    def _skipped_step(self, step: int) -> dict[str, Any]:
        """A step whose batch is skipped on purpose: its samples named, no forward, no update."""
        assert self.spec is not None
        return {
            "step": step,
            "rank": self.spec.rank,
            "replica_ranks": self.spec.plan.replica_ranks,
            "loss": float("nan"),
            "lr": step_learning_rate(step, self.spec.config.training),
            "samples": 0,
            "tokens": 0,
            "step_time_s": 0.0,
            "engine_s": 0.0,
            "update_applied": False,
            "skipped": True,
            "sample_ids": self._sample_ids(step),
            "save": self._writer.report() if self._writer is not None else None,
        }

    def _train_step(self, step: int) -> dict[str, Any]:
        from elastictrain.data.eval_data import source_ids
        from elastictrain.data.sources import collate_items, to_device
        from elastictrain.worker.micro_steps import run_micro_batches

        assert self.spec is not None
        spec, cfg, engine = self.spec, self.spec.config, self.engine
        self._maybe_fault(step)
        self._set_mark("step", step)
        t0 = time.perf_counter()
        lr = step_learning_rate(step, cfg.training)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        samples: list[int] = []
        batches: list[tuple[Any, int]] = []
        for positions, indices in self._micro_reads(step):
            samples.extend(source_ids(self.dataset, indices))
            batch = to_device(collate_items([self.dataset[i] for i in indices], self.collate), engine.device)
            # Dropout and any other randomness depend on the data position, not on rank or world size.
            batches.append((batch, derive_seed(cfg.training.seed, positions.start)))
        self._arm_backward_fault(step)
        collate_s = time.perf_counter() - t0

        forward_backward_s = [0.0]

        def before_update() -> None:
            forward_backward_s[0] = time.perf_counter() - t0  # beside a copy or not: what copies cost
            self.memory.before_update()
            self._maybe_fault(step, "update")

        loss = run_micro_batches(
            engine,
            self.loss_fn,
            batches,
            world_size=spec.world_size,
            on_micro=lambda: self._set_mark("micro", step),
            before_update=before_update,
        )
        elapsed = time.perf_counter() - t0
        self._set_mark("done", step)
        return {
            "step": step,
            "rank": spec.rank,
            "replica_ranks": spec.plan.replica_ranks,  # its replica's ranks report the same samples
            **loss.fields(),
            "lr": lr,
            "samples": len(samples),
            "tokens": len(samples) * cfg.data.seq_len,
            "step_time_s": elapsed,
            "forward_backward_s": forward_backward_s[0],
            "engine_s": elapsed - collate_s,  # forward, backward and update: what any system must run
            "update_applied": update_applied(engine),  # False: skipped, its gradients not finite
            "sample_ids": samples,
            **memory_peaks(engine),
            # How the last background checkpoint write is doing: the controller commits when all are done.
            "save": self._writer.report() if self._writer is not None else None,
        }

    def evaluate(self, step: int) -> dict[str, Any]:
        """This rank's share of a validation of the model after `step` steps (worker/evaluate.py)."""
        from elastictrain.worker.evaluate import evaluate_share

        assert self.spec is not None and self.engine is not None, "evaluate before setup"
        self._set_mark("eval", step)
        out = evaluate_share(self.engine, self.eval_dataset, self.collate, self.loss_fn, self.spec)
        if self.prompts is not None:  # every rank, in lockstep (worker/generate.py)
            from elastictrain.worker.generate import complete

            synced = self.spec.world_size > 1 and zero_stage(self.spec) == 3
            new_tokens = self.spec.config.eval.max_new_tokens
            out["completions"] = complete(self.engine, self.prompts, new_tokens, synced=synced)
        self._set_mark("done", step)
        return {**out, "step": step}
