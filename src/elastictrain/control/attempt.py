"""Starting an attempt, in named steps: choose the workers, choose where the state comes from, build each
rank's spec, set the ranks up, describe what was done. The loop (loop.py) runs them in that order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastictrain.checkpoint.store import Committed
from elastictrain.cluster.calls import Group
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.errors import AttemptFailed
from elastictrain.control.failures import gather_results
from elastictrain.control.memory_recovery import MemoryLoad, MemoryRecovery
from elastictrain.control.record import RunRecorder
from elastictrain.control.reference_pass import ReferencePass
from elastictrain.control.resume import ResumePoints
from elastictrain.control.specs import attempt_specs, replicas_text, set_up_peak_note, slowest_set_up
from elastictrain.core.batch import BatchPlan
from elastictrain.core.policy import Failure
from elastictrain.core.replicas import attempt_workers, nodes_per_replica
from elastictrain.worker.attempt import AttemptSpec


@dataclass(frozen=True)
class Source:
    """Where an attempt's state comes from: the survivors' in-memory snapshots, a checkpoint, or none."""

    memory: MemoryLoad | None
    checkpoint: Committed | None

    @property
    def step(self) -> int:
        if self.memory is not None:
            return self.memory.plan.step
        return int(self.checkpoint.manifest["step"]) if self.checkpoint is not None else 0

    @property
    def name(self) -> str:
        return "memory" if self.memory else "disk" if self.checkpoint else "none"


@dataclass(frozen=True)
class Attempt:
    number: int
    plan: BatchPlan
    workers: list[Any]  # in rank order
    source: Source
    master: tuple[str, int]
    buddies: list[int | None]  # each rank's buddy rank, None without in-memory snapshots
    buddies_off_node: bool  # whether every buddy is on another node than its rank


class AttemptSetUp:
    """The steps of starting an attempt; each says in its name what it does."""

    def __init__(
        self,
        config: Any,
        group: Group,
        recorder: RunRecorder,
        resume: ResumePoints,
        memory: MemoryRecovery,
        reference: ReferencePass,
        clock: Callable[[], float],
    ) -> None:
        self.cfg, self.group, self.recorder = config, group, recorder
        self.resume, self.memory, self.reference, self.clock = resume, memory, reference, clock

    def choose_workers(self, plan: BatchPlan, previous: list[Any], step: int) -> list[Any]:
        size = plan.world_size
        # A tensor-parallel replica's ranks share a node; a pipeline replica's stages may span nodes.
        workers = attempt_workers(
            previous,
            self.group.warm_workers,
            size,
            plan.tensor_parallel,
            lambda w: w.node_id,
            pipeline_stages=plan.pipeline_parallel,
        )
        if len(workers) < size:
            raise AttemptFailed(
                Failure("setup_error", (), step, f"only {len(workers)} of {size} workers ready")
            )
        return workers

    def choose_source(self, step: int) -> Source:
        """The survivors' snapshots when they hold a whole step; else the checkpoint to verify beside."""
        memory = self.memory.take()
        return Source(memory, None if memory else self.resume.candidate(step))

    def attempt(self, number: int, plan: BatchPlan, workers: list[Any], source: Source, step: int) -> Attempt:
        """The attempt on these workers: its rendezvous (rank 0's node, on a port free there now) and
        which rank backs up which."""
        port = gather_results(
            self.group, self.group.call(workers[:1], WorkerApi.free_port), step, timeout_s=60.0, phase="setup"
        )[workers[0].worker_id]
        buddies, off_node = self.memory.buddies(workers)
        return Attempt(number, plan, workers, source, (workers[0].info["node_ip"], port), buddies, off_node)

    def build_specs(self, attempt: Attempt, step: int) -> list[AttemptSpec]:
        checkpoint = attempt.source.checkpoint
        return attempt_specs(
            self.cfg,
            attempt=attempt.number,
            plan=attempt.plan,
            run_id=self.recorder.run_dir.read_info().run_id,
            master=attempt.master,
            start_step=step,
            checkpoint_dir=str(checkpoint.path) if checkpoint else None,
            buddies=[None if b is None else attempt.workers[b].actor for b in attempt.buddies],
            memory=attempt.source.memory,
            node_ids=[w.node_id for w in attempt.workers],
            reference=self.reference.table,
        )

    def set_up(self, attempt: Attempt, specs: list[AttemptSpec], step: int) -> dict[str, Any] | None:
        """Every rank's set-up, the checkpoint verified beside it; the timings, or None when the
        checkpoint they loaded did not verify (now rejected)."""
        with self.resume.verified_beside(attempt.source.checkpoint, step) as verdict:
            calls = self.group.call_each(attempt.workers, WorkerApi.setup, [(spec,) for spec in specs])
            timings = gather_results(
                self.group, calls, step, timeout_s=self.cfg.failure.collective_timeout_s, phase="setup"
            )
        return timings if verdict.ok else None

    def describe(self, attempt: Attempt, timings: dict[str, Any], step: int, began: float) -> None:
        """The attempt_started event: what was set up, from where, and what it cost."""
        plan, source, workers = attempt.plan, attempt.source, attempt.workers
        checkpoint, memory = source.checkpoint, source.memory
        set_up = slowest_set_up(timings, [w.worker_id for w in workers])
        spans = nodes_per_replica([w.node_id for w in workers], plan.replica_ranks)
        self.recorder.event(
            "attempt_started",
            f"attempt {attempt.number}: world size {plan.world_size} (micro batch {plan.micro_batch_size} x "
            f"accumulation {plan.grad_accum_steps} x {replicas_text(plan)} = {plan.global_batch_size}), "
            f"step {step}"
            + (f", from {checkpoint.tag}" if checkpoint else "")
            + (f", from memory (snapshot of attempt {memory.plan.attempt})" if memory else "")
            + _stage_nodes_text(plan, spans)
            + f", set up in {self.clock() - began:.2f}s"
            + set_up_peak_note(set_up["setup_peak_rss_bytes"]),
            step=step,
            attempt=attempt.number,
            world_size=plan.world_size,
            checkpoint=checkpoint.tag if checkpoint else None,
            source=source.name,
            buddies=attempt.buddies,
            buddies_off_node=attempt.buddies_off_node,
            # The sha256 check of the checkpoint (run beside the set-up), next to what loading it cost.
            verify_s=self.resume.last_verify_s if checkpoint else 0.0,
            **set_up,
            actors=[w.actor_id for w in workers],
            workers=[w.worker_id for w in workers],
            master=f"{attempt.master[0]}:{attempt.master[1]}",
            replica_nodes=spans,
        )


def _stage_nodes_text(plan: BatchPlan, spans: list[int]) -> str:
    """With pipeline stages, the nodes each replica's stages span (as few as the workers allowed)."""
    if plan.pipeline_parallel == 1:
        return ""
    return f", each replica's stages on {', '.join(map(str, spans))} node(s)"
