"""The worker with faults a test, benchmark or chaos run injects: a crash, an error or a hang at a step,
a slow disk, a slow copy. Hosted instead of TrainWorker where they ask for it (`worker_class`)."""

from __future__ import annotations

import os
import time
from typing import Any

from elastictrain.worker.actor import TrainWorker

PHASES = ("start", "backward", "update", "replica", "reference")


class WorkerFault(RuntimeError):
    """Raised by an injected fault."""


class FaultyTrainWorker(TrainWorker):
    """TrainWorker whose fault points (`_maybe_fault`, `_arm_backward_fault`) fire what was injected."""

    def _start_run_state(self, worker_id: str) -> None:
        """Faults belong to one run: a warm worker handed to the next run (`leave_run`) drops them."""
        super()._start_run_state(worker_id)
        self._faults: dict[tuple[int, str], str] = {}
        # An injected hang that fired (step, time): the worker reports itself hung from then on, though a
        # hang off the training thread (before a replica is sent) lets that thread mark a few more moves.
        self._hung: tuple[int, float] | None = None
        self._forward_delay_s = 0.0  # a throttled device (the disk's and the copy's delays: TrainWorker's)
        self._delayed_engine: object = None

    def inject_fault(self, kind: str, at_step: int, phase: str = "start") -> None:
        """At `at_step`, "crash" (process exits), "raise" (step raises), "hang" (stops) or "nan" (the first
        micro-batch's logits on this rank come out NaN, as from a bad batch: its loss and gradients are
        not finite; phase "start" only) or "corrupt" (a weight of this rank becomes NaN and stays so, as
        from a device's silent error; phase "start" only) or "spike" (that step's logits on this rank come out
        1000 times as large: a finite loss spike; phase "start" only), at one of
        PHASES of that step: its start (before any forward), inside its first micro-batch's backward
        pass, right before its optimizer update, or right before the replica of the snapshot taken beside
        it is sent to the buddy (the buddy then never gets that replica; the training thread waits at the
        next step's start until the fault fires, so the worker stops as a node lost at that moment does,
        joining none of the next step's collectives); "reference": at the start of the reference pass's
        chunk that starts at item `at_step`."""
        if kind not in ("crash", "raise", "hang", "nan", "corrupt", "spike"):
            raise ValueError(f"fault kind: got {kind!r}; expected crash, raise, hang, nan, corrupt or spike")
        if phase not in PHASES:
            raise ValueError(f"fault phase: got {phase!r}; expected one of {', '.join(PHASES)}")
        self._faults[(at_step, phase)] = kind

    def inject_forward_delay(self, seconds: float) -> None:
        """Every later forward pass on this rank takes `seconds` longer, as on a throttled device."""
        self._forward_delay_s = float(seconds)

    def inject_write_delay(self, seconds: float) -> None:
        """Every later checkpoint write starts `seconds` late, as on a slow disk."""
        self._write_delay_s = float(seconds)

    def inject_snapshot_delay(self, seconds: float) -> None:
        """Every later in-memory copy starts `seconds` late, so a failure can strike in the middle of one."""
        self.memory.delay_s = float(seconds)

    def progress(self) -> dict[str, Any]:
        out = super().progress()
        if self._hung is not None:
            out["phase"], (out["step"], out["since"]) = "hung", self._hung
        return out

    def _maybe_fault(self, step: int, phase: str = "start") -> None:
        if phase == "start" and self._forward_delay_s > 0:
            self._delay_forwards()
        # The snapshot of the state after `step` steps is copied, and its replica sent, beside this step.
        if phase == "start" and (self._hung or self._faults.get((step, "replica")) in ("crash", "hang")):
            self._stop_with_the_replica_fault(step)
        kind = self._faults.pop((step, phase), None)
        if kind in ("nan", "spike"):
            spike = kind == "spike"
            assert self.spec is not None
            self._arm_logits(
                1000.0 if spike else float("nan"), self.spec.plan.grad_accum_steps if spike else 1
            )
        if kind == "corrupt":
            self._corrupt_a_weight()
        if kind == "crash":
            os._exit(17)
        if kind == "raise":
            raise WorkerFault(f"injected fault in worker {self.worker_id} at step {step}")
        if kind == "hang":
            self._hung = (step, time.time())
            self._set_mark("hung", step)
            while True:  # stops stepping without dying, holding no lock the control thread needs
                time.sleep(3600)

    def _stop_with_the_replica_fault(self, step: int) -> None:
        """The snapshot thread's fault before the replica of the state after `step` steps fires beside
        this step (or has fired): without this wait the training thread would take part in this step's
        collectives, and the other ranks, finishing it, would copy past the snapshot a recovery needs.
        Bounded: a copy that never comes (snapshots turned off) lets training go on."""
        deadline = time.monotonic() + 120
        while (step, "replica") in self._faults and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._hung is not None:
            while True:  # the hang that fired holds this thread too
                time.sleep(3600)

    def _arm_backward_fault(self, step: int) -> None:
        """A fault injected at (`step`, "backward") fires inside the first micro-batch's backward pass:
        from a backward hook on the module whose gradients come first (the one registered last)."""
        if (step, "backward") not in self._faults:
            return
        trainable = [
            m
            for m in self.engine.module.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        handles: list[Any] = []

        def fire(*_: Any) -> None:
            for h in handles:
                h.remove()
            self._maybe_fault(step, "backward")

        handles.append(trainable[-1].register_full_backward_hook(fire))

    def _arm_logits(self, factor: float, forwards: int) -> None:
        """The next `forwards` forwards' output layer (its head, or its last linear layer) returns its
        output times `factor` (NaN: a non-finite loss)."""
        import torch

        module = self.engine.module
        # A transformers model's head, whatever tensor parallelism replaced it with; else the last Linear.
        head = getattr(module, "get_output_embeddings", lambda: None)()
        if head is None:
            head = [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1]
        handles: list[Any] = []
        left = [forwards]

        def poison(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
            left[0] -= 1
            if left[0] <= 0:
                for h in handles:
                    h.remove()
            return output * factor

        handles.append(head.register_forward_hook(poison))

    def _corrupt_a_weight(self) -> None:
        """The model's first weight becomes NaN in place, once the copy of the last state is finished (that
        snapshot stays clean, as one taken before a device went bad)."""
        import torch

        self.memory.copy_finished()
        with torch.no_grad():
            next(self.engine.module.parameters()).fill_(float("nan"))

    def _delay_forwards(self) -> None:
        """This attempt's model sleeps before each forward (once per engine: a new attempt builds anew)."""
        if self._delayed_engine is self.engine:
            return
        self._delayed_engine = self.engine
        self.engine.module.register_forward_pre_hook(lambda *_: time.sleep(self._forward_delay_s))
