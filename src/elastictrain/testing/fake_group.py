"""A worker group without Ray, for unit tests and benchmarks of the control loop: scripted scenarios.

Each fake worker answers the calls the loop makes (setup, train_step, save_shard, save_status,
teardown, free_port) at once and in order, as an actor runs its calls one after another. Rank files
are real (a few bytes each), so the checkpoint store commits and verifies them as it would a real
run's. A scenario is scripted before or during the run:

    group = FakeGroup(capacity=4)
    group.die_at_step(rank=1, step=5)             # the rank's process dies running step 5
    group.write_fails(rank=0, error=ENOSPC)       # its next background write ends in this error
    group.save_hangs(rank=1)                      # its next background write never ends
    group.drop_file(rank=1)                       # its next write says done, but the file is not there
    group.die_in_save(rank=0)                     # its process dies taking the next snapshot
    group.add_capacity(2)                         # two more reservations are placed
    group.copy_unfinished(rank=1, step=6)         # its in-memory copy of step 6 never completes
    group.killed_for_memory_at_step(rank=1, step=5)  # Ray's memory monitor kills it running step 5

Workers keep in-memory snapshots as real ones do (the last two of their own rank and of their
buddy's, after every `checkpoint.memory_every_steps` step); a step does not complete while a peer of
its attempt is dead (a real one would wait in a collective).

A call to a dead worker replies DIED (NODE_LOST once its node is removed); a call to a hung worker
TIMED_OUT, at once: the fake never waits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from elastictrain.cluster.calls import (
    DIED,
    NODE_LOST,
    OUT_OF_MEMORY,
    RAISED,
    TIMED_OUT,
    Calls,
    Reply,
    WorkerViews,
)
from elastictrain.cluster.worker_api import WorkerMethod, method_name
from elastictrain.testing.fake_worker import (
    ENOSPC,
    FakeDied,
    FakeFault,
    FakeHung,
    FakeKilledForMemory,
    FakeWorker,
    FakeWrite,
)

__all__ = ["ENOSPC", "FakeGroup", "FakeWorker"]


class FakeGroup(WorkerViews):
    """Implements cluster.calls.Group for `capacity` worker slots, all placed at once."""

    # WorkerApi methods the fake's workers do not answer, and why (a call to one raises).
    NOT_MODELLED = {
        "info": "a fake worker's identity is its FakeWorker.info",
        "progress": "FakeGroup.progress answers for the group",
        "warmup": "poll_warm warms fake workers",
        "leave_run": "a fake group is never handed to a next run",
        "reference_items": "the loop's unit tests train language-model objectives only",
        "reference_logps": "the loop's unit tests train language-model objectives only",
        "use_reference": "the loop's unit tests train language-model objectives only",
    }

    def __init__(self, capacity: int, *, nodes: int | None = None, warmup_polls: int = 1) -> None:
        self.capacity = capacity
        self.warmup_polls = warmup_polls
        self._never_warm: set[str] = set()  # worker ids whose warm-up never ends
        self.workers: list[FakeWorker] = []
        self.pending: list[int] = []  # reservations not turned into workers yet
        self._nodes = nodes or capacity  # workers are spread over this many nodes, round-robin
        self._lost_nodes: set[str] = set()
        self._ids = itertools.count()
        self._faults: list[FakeFault] = []
        self.removed: list[str] = []
        self.node_queries = 0  # cluster queries made (one per check, not one per worker)
        self.warmup_errors: list[tuple[str, str]] = []
        self._warmup_error = ""  # every warm-up raises this (e.g. a data config error)
        self.eval_loss_at: dict[int, float] = {}  # steps trained -> validation loss (default 1/steps)
        self.loss_at: dict[int, float] = {}  # step index -> its training loss (default 10/(step + 1))
        self.avoided: list[tuple[str, float]] = []  # (node, seconds) asked of avoid_node
        self.nan_steps: set[int] = set()  # step indices whose loss is NaN and update not applied
        self._broken_attempts: set[int] = set()  # attempts one of whose workers died
        self.memory_report: dict[str, Any] = {}  # every step's `memory` report ({"off": why}: no copies)
        # Every fake run's rendezvous: a test that plants shm buffers under it picks one no other run uses.
        self.rendezvous_port = 29500

    def _died(self, w: FakeWorker) -> None:
        w.dead = True
        attempt = getattr(w.spec, "attempt", None)
        if attempt is not None:
            self._broken_attempts.add(attempt)

    # -- scenario --
    def warmup_raises(self, error: str) -> None:
        self._warmup_error = error

    def die_at_step(self, rank: int, step: int) -> None:
        self._faults.append(FakeFault("die", rank, step))

    def killed_for_memory_at_step(self, rank: int, step: int) -> None:
        self._faults.append(FakeFault("oom", rank, step))

    def hang_at_step(self, rank: int, step: int) -> None:
        self._faults.append(FakeFault("hang", rank, step))

    def raise_at_step(self, rank: int, step: int, error: str = "RuntimeError: boom") -> None:
        self._faults.append(FakeFault("raise", rank, step, error))

    def write_fails(self, rank: int, error: str = ENOSPC) -> None:
        self._faults.append(FakeFault("write_error", rank, detail=error))

    def save_hangs(self, rank: int) -> None:
        self._faults.append(FakeFault("save_hangs", rank))

    def die_in_save(self, rank: int) -> None:
        self._faults.append(FakeFault("die_in_save", rank))

    def drop_file(self, rank: int) -> None:
        self._faults.append(FakeFault("drop_file", rank))

    def copy_unfinished(self, rank: int, step: int) -> None:
        self._faults.append(FakeFault("copy_unfinished", rank, step))

    def add_capacity(self, n: int) -> None:
        self.capacity += n

    def lose_node_of(self, worker: FakeWorker) -> None:
        self._lost_nodes.add(worker.node_id)
        for w in self.workers:
            if w.node_id == worker.node_id:
                self._died(w)

    def _take(self, kind: str, rank: int, step: int = -1) -> FakeFault | None:
        for f in self._faults:
            if f.kind == kind and f.rank == rank and f.step == step:
                self._faults.remove(f)
                return f
        return None

    # -- reservations and actors --
    def _free_slots(self) -> int:
        return self.capacity - len(self.workers)

    def request(self, n: int) -> None:
        self.pending.extend(range(n))

    def ready_reservations(self, timeout_s: float = 0.0) -> int:
        return min(len(self.pending), self._free_slots())

    def wait_for_reservations(self, n: int, timeout_s: float) -> int:
        return self.ready_reservations()

    def start_workers(self, limit: int, config: Any) -> list[FakeWorker]:
        new = []
        for _ in range(min(limit, self.ready_reservations())):
            self.pending.pop()
            i = next(self._ids)
            node = f"node-{i % self._nodes:04d}"
            new.append(FakeWorker(f"fw{i}", node, info={"node_ip": "127.0.0.1", "node_id": node}))
        self.workers.extend(new)
        return new

    def never_warm(self, worker_number: int) -> None:
        """The `worker_number`-th worker started (1-based) never finishes its warm-up (a hung import)."""
        self._never_warm.add(f"fw{worker_number - 1}")

    def poll_warm(self, timeout_s: float = 0.0, n: int | None = None) -> list[FakeWorker]:
        """A new worker is warm from its second look on: one that starts after a failure is not
        there for the restart right away (survivors restart alone, the newcomer joins by a grow)."""
        became = []
        for w in self.warming:
            w.polls += 1
            if w.worker_id in self._never_warm:
                continue
            if w.polls > self.warmup_polls and self._warmup_error:
                self.warmup_errors.append((w.worker_id, self._warmup_error))
                self.remove(w)
            elif w.polls > self.warmup_polls:
                w.warm = True
                became.append(w)
        return became

    def avoid_node(self, node_id: str, seconds: float) -> None:
        self.avoided.append((node_id, seconds))

    def remove(self, handle: Any, *, kill: bool = True) -> None:
        if handle in self.workers:
            self.workers.remove(handle)
            self.removed.append(handle.worker_id)
        self._died(handle)

    def progress(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any] | None]:
        # A worker in no attempt (a spare, or warm and waiting to join) is idle: in no collective.
        return {
            w.worker_id: None
            if w.dead
            else {
                "since": 0.0 if w.hung else 1.0,
                "step": w.step,
                "in_collective": not w.hung and w.spec is not None,
                "where": "hung" if w.hung else "allreduce" if w.spec is not None else "idle",
            }
            for w in self.workers
        }

    def nodes_alive(self) -> set[str]:
        self.node_queries += 1
        return {f"node-{i:04d}" for i in range(self._nodes)} - self._lost_nodes

    def shutdown(self) -> None:
        for w in list(self.workers):
            self.remove(w)
        self.pending.clear()

    # -- calls --
    def call(
        self,
        workers: Sequence[Any],
        method: WorkerMethod,
        *args: Any,
        control: bool = False,
        watch: bool = False,
    ) -> Calls:
        name = self._modelled(method_name(method))
        if watch:  # a long wait's reply, as it stands when the call is made (see _watch_save_status)
            return {w.worker_id: self._run(w, f"watch_{name}", args, True) for w in workers}
        return {w.worker_id: self._run(w, name, args, control) for w in workers}

    def call_each(
        self, workers: Sequence[Any], method: WorkerMethod, args: Sequence[tuple[Any, ...]]
    ) -> Calls:
        name = self._modelled(method_name(method))
        return {w.worker_id: self._run(w, name, a, False) for w, a in zip(workers, args, strict=True)}

    def gather(
        self,
        calls: Calls,
        timeout_s: float,
        *,
        stop_on_error: bool = False,
        grace_s: float = 3.0,
    ) -> dict[str, Reply]:
        replies = dict(calls)
        if any(r.error == DIED for r in replies.values()):
            alive = self.nodes_alive()
            node_of = {w.worker_id: w.node_id for w in self.workers}
            for wid, r in replies.items():
                if r.error == DIED and wid in node_of and node_of[wid] not in alive:
                    replies[wid] = Reply(wid, error=NODE_LOST, detail=r.detail, node_id=node_of[wid])
        return replies

    def _modelled(self, name: str) -> str:
        if name in self.NOT_MODELLED:
            raise NotImplementedError(f"the fake group does not answer {name}: {self.NOT_MODELLED[name]}")
        return name

    def _run(self, w: FakeWorker, method: str, args: tuple[Any, ...], control: bool) -> Reply:
        w.calls.append(method)
        if w.dead:
            return Reply(w.worker_id, error=DIED, detail=f"The actor {w.worker_id} died")
        if w.hung and not control:
            return Reply(w.worker_id, error=TIMED_OUT, detail="no answer")
        try:
            return Reply(w.worker_id, getattr(self, f"_{method}")(w, *args))
        except FakeDied:
            self._died(w)
            return Reply(w.worker_id, error=DIED, detail=f"The actor {w.worker_id} died")
        except FakeKilledForMemory:
            self._died(w)
            memory = "Memory on the node (IP: 127.0.0.1, ID: fake) was 23.1GB / 24.0GB (0.96)"
            return Reply(
                w.worker_id,
                error=OUT_OF_MEMORY,
                detail=f"Task was killed due to the node running low on memory.\n{memory}. Ray killed it.",
            )
        except FakeHung:
            w.hung = True
            return Reply(w.worker_id, error=TIMED_OUT, detail="no answer")
        except RuntimeError as e:
            return Reply(w.worker_id, error=RAISED, detail=str(e))

    # -- what a TrainWorker answers --
    def _free_port(self, w: FakeWorker) -> int:
        return self.rendezvous_port

    def _setup(self, w: FakeWorker, spec: Any) -> dict[str, float]:
        w.spec, w.step, w.writer = spec, spec.start_step, None
        return {"total_s": 0.0, "load_s": 0.0}

    def _train_step(
        self, w: FakeWorker, step: int, snapshot: bool | None = None, probe: bool = False, skip: bool = False
    ) -> dict[str, Any]:
        rank = w.spec.rank
        if skip or step in self.nan_steps:  # skipped on purpose, or a non-finite loss: not applied
            w.step = step + 1
            return {
                "memory": dict(self.memory_report),
                "step": step,
                "rank": rank,
                "loss": float("nan"),
                "lr": 1e-3,
                "samples": 0 if skip else 1,
                "tokens": 0 if skip else 1,
                "step_time_s": 0.0,
                "update_applied": False,
                **({"skipped": True} if skip else {}),
                "sample_ids": [step * w.spec.world_size + rank],
                "save": w.writer.report() if w.writer is not None else None,
            }
        if self._take("die", rank, step):
            raise FakeDied
        if self._take("oom", rank, step):
            raise FakeKilledForMemory
        if self._take("hang", rank, step):
            raise FakeHung
        fault = self._take("raise", rank, step)
        if fault:
            raise RuntimeError(fault.detail)
        peer_dies = any(f.kind in ("die", "oom") and f.step == step and f.rank != rank for f in self._faults)
        if peer_dies or getattr(w.spec, "attempt", None) in self._broken_attempts:
            raise RuntimeError("gloo: Connection closed by peer")  # its collective with the dead one fails
        if w.writer is not None:
            w.writer.finish()  # a background write ends while the next step runs
        w.step = step + 1
        if snapshot and not self.memory_report.get("off"):
            self._snapshot(w, step + 1)
        return {
            "memory": dict(self.memory_report),
            "step": step,
            "rank": rank,
            "loss": self.loss_at.get(step, 10.0 / (step + 1)),
            "lr": 1e-3,
            "samples": 1,
            "tokens": 1,
            "step_time_s": 0.0,
            "sample_ids": [step * w.spec.world_size + rank],
            "save": w.writer.report() if w.writer is not None else None,
        }

    def _evaluate(self, w: FakeWorker, step: int) -> dict[str, Any]:
        # A validation loss of 1/steps trained (or eval_loss_at's), its 60 target tokens shared among ranks.
        size = w.spec.world_size
        tokens = 60 // size
        return {
            "rank": w.spec.rank,
            "loss_sum": tokens * self.eval_loss_at.get(w.step, 1 / w.step),
            "target_tokens": tokens,
            "samples": 12 // size,
        }

    def _save_shard(self, w: FakeWorker, staging_dir: str, background: bool = False) -> dict[str, Any]:
        rank = w.spec.rank
        if self._take("die_in_save", rank):
            raise FakeDied
        name = f"rank-{rank:05d}-of-{w.spec.world_size:05d}.safetensors"
        write = FakeWrite(staging_dir, name, rank)
        fault = self._take("write_error", rank)
        write.error = fault.detail if fault else ""
        write.hangs = self._take("save_hangs", rank) is not None
        write.drop = self._take("drop_file", rank) is not None
        out: dict[str, Any] = {
            "name": name,
            "engine_state": {"global_steps": w.step},
            "snapshot_s": 0.0,
            "save_s": 0.0,
            "waited_s": 0.0,
        }
        if background:
            w.writer = write
        else:
            write.finish()
            if write.state == "error":
                raise RuntimeError(write.error)
            out["file"] = write.file
        return out

    def _save_status(self, w: FakeWorker, staging_dir: str, wait_s: float = 0.0) -> dict[str, Any]:
        if w.writer is not None and w.writer.staging == staging_dir:
            w.writer.finish()  # waiting for it lets it end
        return self._watch_save_status(w, staging_dir)

    def _watch_save_status(self, w: FakeWorker, staging: str, wait_s: float = 0.0) -> dict[str, Any]:
        """A watch on the write: its state now, as if its wait ran out (a fake write ends only with the
        rank's next step, or when a save_status waits for it)."""
        write = w.writer
        if write is None or write.staging != staging:
            return {"staging": staging, "state": "error", "error": "no such write on this worker"}
        return write.report()

    def _snapshot(self, w: FakeWorker, steps_done: int) -> None:
        # The controller marks the steps (control/snapshot_schedule.py); a rank copies only when on.
        if not getattr(w.spec, "snapshot_every", 0) or self._take("copy_unfinished", w.spec.rank, steps_done):
            return
        key = {"attempt": w.spec.attempt, "world_size": w.spec.world_size, "rank": w.spec.rank}
        w.own = [*w.own, {**key, "step": steps_done, "own": True}][-2:]
        buddy = getattr(w.spec, "buddy", None)
        if buddy is not None and not buddy.dead:
            buddy.replicas = [*buddy.replicas, {**key, "step": steps_done, "own": False}][-2:]

    def _hand_off_snapshots(self, w: FakeWorker, target: FakeWorker) -> int:
        target.replicas = target.replicas + [{**h, "own": False} for h in w.own + w.replicas]
        return len(w.own) + len(w.replicas)

    def _snapshot_now(self, w: FakeWorker) -> dict[str, Any]:
        if not any(h["step"] == w.step and h["attempt"] == w.spec.attempt for h in w.own):
            self._snapshot(w, w.step)
        held = any(h["step"] == w.step and h["attempt"] == w.spec.attempt for h in w.own)
        return {"step": w.step, "held": held, "off": ""}

    def _memory_holdings(self, w: FakeWorker) -> list[dict[str, Any]]:
        return w.own + w.replicas

    def _abort_collectives(self, w: FakeWorker) -> int:
        return 0

    def _teardown(self, w: FakeWorker) -> dict[str, float]:
        if w.writer is not None:
            w.writer.finish()
            if w.writer.state == "writing":  # a hung write: the real actor's teardown waits on it
                raise FakeHung
        w.spec, w.writer = None, None
        return {"teardown_s": 0.0}
