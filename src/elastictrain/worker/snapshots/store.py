"""The worker's side of in-memory snapshots: take them, replicate them to the buddy, serve and load them.

After each step the controller marks (the same steps on every rank: `checkpoint.memory_every_steps`
spaced out to cost at most `checkpoint.memory_max_step_share`) the rank copies its slice of the state
to host memory in a thread while the next step's forward and backward run; the next optimizer update waits
for the copy (`before_update`), so the copy always sees the state of one step. The finished copy is
then sent to the buddy (another worker, on another node when there is one) over a socket into the
buddy's process (worker/snapshots/replica_link.py; by an actor call in the buddy's `replica` concurrency group
where that socket cannot be reached), beside its own training. A new attempt loads from the snapshots
through worker/snapshots/load.py. With the optimizer state on
NVMe the copy runs inline: swapping in from a second thread would race the step's own swapping.
The first copy of an attempt also measures the slice: where the copies a worker may hold would not fit
in the host memory checkpointing may use, it is dropped and snapshots stay off for the attempt, said
in every step's report (the controller then recovers from disk and says why).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from elastictrain.core.snapshot_plan import SnapshotKey, slices_held, snapshots_unaffordable
from elastictrain.worker.attempt import MemorySource
from elastictrain.worker.ray_calls import REPLICATE_TIMEOUT_S, call_peer
from elastictrain.worker.snapshots.copy_stream import copy_stream, on_stream
from elastictrain.worker.snapshots.replica_link import BuddyLink, ReplicaServer, pieces_answer

# worker/snapshots/format.py (Snapshot, SnapshotStore) imports torch: it is imported where a worker
# first uses it, since the driver imports this module for the actor class Ray starts and needs no torch.
if TYPE_CHECKING:
    from elastictrain.worker.snapshots.format import Snapshot


class WorkerMemory:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        from elastictrain.worker.snapshots.format import SnapshotStore

        self.store = SnapshotStore()
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._every = 0
        self._inline = False
        self._buddy: Any = None
        self._identity: tuple[int, int, int] = (0, 0, 0)  # attempt, world size, rank
        self._budget: Callable[[], float] = lambda: float("inf")
        self._checked = False  # whether this attempt's slice was measured against the budget
        self.off = ""  # why snapshots are off for this attempt (too large for the budget), or ""
        self._steps_done = -1  # after the attempt's last step
        self._copying: SnapshotKey | None = None  # the last copy started (maybe complete)
        self._deferred: tuple[Any, SnapshotKey] | None = None  # a probe's copy, started by the next update
        self._for_disk: dict[SnapshotKey, Future[Any]] = {}  # copies a checkpoint write waits for
        # The own snapshot a disk checkpoint writes, and a wait for that write: its buffer is reused after.
        self._lent: tuple[SnapshotKey, Callable[[], Any] | None] | None = None
        self._lock = threading.Lock()
        self.delay_s = 0.0  # tests: a slow copy, to fail in the middle of one
        self.before_replica: Callable[[int], None] = lambda step: None  # tests: a fault before it is sent
        self.last_copy_s = 0.0
        self.last_replicate_s = 0.0
        self.last_fetch_s = 0.0  # the last load's time asking the snapshots' holders for their pieces
        # CPU seconds of the last copy, of sending its replica, and of keeping the buddy's last replica:
        # on CPU workers each one is taken from training (control/snapshot_schedule.py).
        self.cpu_s = {"copy": 0.0, "replicate": 0.0, "hold": 0.0}
        self.error = ""
        self._update_wait_s = 0.0
        self._link: BuddyLink | None = None  # how replicas reach the buddy (worker/snapshots/replica_link.py)
        self._server: ReplicaServer | None = None  # where the worker this one backs up sends replicas

    # -- in an attempt --
    def attach(
        self,
        attempt: int,
        world_size: int,
        rank: int,
        every: int,
        buddy: Any,
        inline: bool,
        budget: Callable[[], float] | None = None,
    ) -> None:
        """Join an attempt; `budget()` is the host memory (bytes) this rank's snapshots may take."""
        self.copy_finished()
        self._deferred = None
        self._update_wait_s = 0.0
        self._identity = (attempt, world_size, rank)
        self._every, self._buddy, self._inline = every, buddy, inline
        self._budget = budget or (lambda: float("inf"))
        self._checked, self.off = False, ""
        self.cpu_s = dict.fromkeys(self.cpu_s, 0.0)  # measured anew at this attempt's slice size

    def after_step(
        self, engine: Any, steps_done: int, due: bool | None = None, *, probe: bool = False
    ) -> None:
        """The state after `steps_done` steps is final: copy it (in a thread unless inline) when `due`
        (the controller's mark; None: every `every` steps, for callers without a controller).

        `probe`: the copy starts only when the next step's forward and backward are done, and that
        update waits for it, so that step's forward and backward run with no copy beside them: the
        controller's baseline for what copies beside a step cost (control/snapshot_schedule.py). A
        failure during that step still loses at most the step before it, as when its copy is beside it.
        """
        self._steps_done = steps_done
        self._deferred = None
        if due is None:
            due = self._every > 0 and steps_done % self._every == 0
        if not due or self._every <= 0 or self.off:
            return
        self.wait()  # one copy and one replication at a time
        self.copy_finished()  # a checkpoint's own copy (copy_for_disk) too
        key = SnapshotKey(*self._identity, steps_done)
        if probe and not self._inline and self._checked:
            self._deferred = (engine, key)
            return
        self._start_copy(engine, key)

    def _start_copy(self, engine: Any, key: SnapshotKey) -> None:
        self._copying = key
        self._copied.clear()
        if self._inline:
            self._take(engine, key, None)
            return
        stream = copy_stream(engine)  # on a GPU: the copy's own CUDA stream, after this step's kernels
        self._thread = threading.Thread(
            target=self._take, args=(engine, key, stream), name="memory-snapshot", daemon=True
        )
        self._thread.start()

    def copy_for_disk(self, engine: Any, max_bytes: float) -> tuple[Callable[[], Any], None] | None:
        """A copy of the state after the last step for a disk checkpoint alone (not kept, not replicated),
        where no snapshot of that state was started: taken in a thread while the next step's forward and
        backward run, and the next update waits for it (`before_update`), so the checkpoint pauses
        training only as long as the copy outlasts them. For `checkpoint/rank_save.py` (`held`): a
        function that waits for the copy (None if it failed). None where copies run inline (state on
        NVMe) or the copy would exceed what `max_bytes` leaves beside the in-memory snapshots' buffers:
        the checkpoint then copies or streams as it is."""
        from elastictrain.checkpoint.rank_snapshot import snapshot_bytes, take_snapshot

        if self._inline or snapshot_bytes(engine) > max_bytes - self.reserved_bytes():
            return None
        future: Future[Any] = Future()

        def take() -> None:
            raw = None
            try:
                time.sleep(self.delay_s)
                raw = take_snapshot(engine)
            except Exception as e:  # noqa: BLE001 - the write reports the failed copy; the next save copies again
                self.error = f"checkpoint copy: {type(e).__name__}: {e}"
            finally:
                future.set_result(raw)

        self.hold_updates_for(engine, take, "checkpoint-copy")
        return future.result, None

    def reserved_bytes(self) -> int:
        """The host memory the in-memory snapshots' buffers take at most (those held, and the spares an
        arriving replica or a copy in progress is written into) at the slice size last copied."""
        newest = self.store.own[-1].nbytes if self.store.own else 0
        return max(self.store.nbytes(), slices_held(self._buddy is not None) * newest)

    @property
    def copies_inline(self) -> bool:
        """Whether copies of the state must run in the calling thread (optimizer state on NVMe)."""
        return self._inline

    def hold_updates_for(self, engine: Any, run: Callable[[], None], name: str = "checkpoint-stream") -> None:
        """Run `run` (a checkpoint's copy of the state, or its write streamed from the live state) in a
        thread beside the next step's forward and backward, which do not change the state it reads; the
        next update waits for it (`before_update`). With state on NVMe (`copies_inline`) `run` must read
        the swap files itself (checkpoint/swap_stream.py): DeepSpeed's swapper is the step's."""
        self.copy_finished()  # one reader of the live state at a time
        stream = copy_stream(engine)
        self._copied.clear()

        def go() -> None:
            try:
                with on_stream(stream):
                    run()
            finally:
                self._copied.set()

        threading.Thread(target=go, name=name, daemon=True).start()

    def before_update(self) -> None:
        """The optimizer is about to change the state: the copy in progress must be finished. The wait
        is training held up by the copy (`pop_update_wait`)."""
        t0 = time.perf_counter()
        if self._deferred is not None:  # a probe's copy: now, alone, while the update waits
            engine, key = self._deferred
            self._deferred = None
            self._start_copy(engine, key)
        self.copy_finished()
        self._update_wait_s += time.perf_counter() - t0

    def copy_finished(self) -> None:
        """Wait for the copy in progress (not for its replication), if any."""
        self._copied.wait()

    def close(self) -> None:
        """The run is over: let the last copy and its replication end, close the replica sockets and
        give back every snapshot and replica held (a warm actor keeps none for its next run; it takes
        a new WorkerMemory)."""
        self.wait()
        self.copy_finished()
        if self._link is not None:
            self._link.close()
        if self._server is not None:
            self._server.close()
        from elastictrain.worker.snapshots.format import SnapshotStore

        self.store = SnapshotStore()  # freed now, not when a receiving thread of the closed socket ends

    def pop_update_wait(self) -> float:
        """Seconds spent waiting for a copy since the last call: training held up by it."""
        waited, self._update_wait_s = self._update_wait_s, 0.0
        return waited

    def wait(self) -> None:
        """Let the copy and its replication end (before the next copy)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def snapshot_last_step(self, engine: Any) -> dict[str, Any]:
        """Copy the state after the last step unless that copy was started; wait for it and its replica."""
        if self.live_key() != self._copying:  # not started, or a probe's copy not started yet
            self.after_step(engine, self._steps_done, True)
        self.wait()
        return {
            "step": self._steps_done,
            "held": self.store.find(self.live_key()) is not None,
            "off": self.off,
        }

    def live_key(self) -> SnapshotKey:
        """The key a snapshot of the state after the last step has."""
        return SnapshotKey(*self._identity, self._steps_done)

    def for_disk(self) -> tuple[Callable[[], Any], dict[str, Any] | None] | None:
        """The copy of the state after the last step, for a checkpoint to write instead of copying again:
        (a function that waits for the copy and returns it as checkpoint/rank_snapshot.Snapshot or None
        if it failed, its scalars when already complete). None when no copy of that state was started."""
        key = self.live_key()
        if self._copying != key:
            return None
        if not self._checked:
            self._copied.wait()  # the attempt's first copy decides whether snapshots fit at all
        if self.off:
            return None
        with self._lock:
            done = self.store.find(key)
            self._lent = (key, None)  # the write says when it ends (`lent_until`)
            future: Future[Any] = Future()
            if done is not None or self._copied.is_set():
                future.set_result(done.raw if done is not None else None)
            else:
                self._for_disk[key] = future
        return future.result, (done.scalars if done is not None else None)

    def _copy_ended(self, key: SnapshotKey, snap: Snapshot | None) -> None:
        # Under the lock with the event, so that `for_disk` either finds the copy ended or registers first.
        with self._lock:
            future = self._for_disk.pop(key, None)
            self._copied.set()  # held before anyone waiting on the copy (leaving, the next update) goes on
        if future is not None:
            future.set_result(snap.raw if snap is not None else None)

    def _take(self, engine: Any, key: SnapshotKey, stream: Any) -> None:
        from elastictrain.checkpoint.rank_snapshot import Walked, take_snapshot
        from elastictrain.checkpoint.zero_state import fragments_of

        snap: Snapshot | None = None
        try:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            budget = None if self._checked else self._budget()  # before the copy takes its share
            if budget is not None and budget <= 0:  # no memory for checkpoints at all: not even one copy
                self._checked, self.off = True, "checkpoint.max_host_memory_mb=0 leaves snapshots no memory"
                return
            if self.delay_s:
                time.sleep(self.delay_s)
            # The attempt's first copy is refused before its buffer is allocated where the copies a worker
            # holds would not fit: at 1B parameters one copy alone is gigabytes a loaded host may not have.
            found = Walked()
            has_buddy = self._buddy is not None
            limit = float("inf") if budget is None else budget / slices_held(has_buddy)
            into = self._spare_buffer(key)
            with on_stream(stream):  # device-to-host into pinned memory beside the next step's kernels
                raw = take_snapshot(engine, limit, found, into=into)
            if budget is not None:
                self._checked = True
                assert found.plan is not None
                self.off = snapshots_unaffordable(found.plan.data_bytes, budget, has_buddy=has_buddy) or ""
                if self.off or raw is None:
                    return  # nothing is copied, kept or replicated in this attempt
            assert raw is not None
            pieces = fragments_of(raw.plan.pieces)
            from elastictrain.worker.snapshots.format import Snapshot

            snap = Snapshot(key, raw.tensors(), pieces, raw.scalars, copy_s=time.perf_counter() - t0, raw=raw)
            self.last_copy_s = snap.copy_s
            self.cpu_s["copy"] = time.thread_time() - cpu0
            with self._lock:
                self.store.add_own(snap)  # complete: only now may it stand for this rank
        except Exception as e:  # noqa: BLE001 - a failed copy leaves the last complete one in place
            self.error = f"{type(e).__name__}: {e}"
            snap = None
            return
        finally:
            self._copy_ended(key, snap)  # a checkpoint write waiting for this copy gets it (or None)
        if self._buddy is not None:
            self._replicate(snap)

    def _spare_buffer(self, key: SnapshotKey) -> Any:
        """The buffer of the own snapshot last pushed out, for this copy to be written into (None: a new
        one). Where a disk checkpoint still writes that snapshot, the copy waits for the write: beside
        the step, so training waits only where the write outlasts the two steps since."""
        spare = self.store.take_spare(own=True, attempt=key.attempt)
        if spare is None:
            return None
        # Read once, never cleared here: the next checkpoint may hand out another snapshot meanwhile, and
        # waiting on a write that has ended returns at once.
        lent = self._lent
        if lent is not None and lent[0] == spare.key:
            if lent[1] is None:  # handed out, its write not known to have started: never overwritten
                return None
            lent[1]()
        return spare.buffer

    def lent_until(self, wait: Callable[[], Any]) -> None:
        """The disk write of the snapshot `for_disk` last handed out has started; `wait()` ends with it."""
        if self._lent is not None and self._lent[1] is None:
            self._lent = (self._lent[0], wait)

    def _replicate(self, snap: Snapshot) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self.before_replica(snap.key.step)
        try:
            if self._link is None or self._link.buddy is not self._buddy:
                if self._link is not None:
                    self._link.close()
                buddy = self._buddy
                self._link = BuddyLink(
                    buddy, lambda: call_peer(buddy, "replica_address"), REPLICATE_TIMEOUT_S
                )
            self._link.send(snap, lambda: call_peer(self._buddy, "hold_replica", snap.to_wire()))
        except Exception as e:  # noqa: BLE001 - a lost buddy: the controller sees its failure itself
            self.error = f"replica of step {snap.key.step} not held: {type(e).__name__}: {e}"
        self.last_replicate_s = time.perf_counter() - t0
        self.cpu_s["replicate"] = time.thread_time() - cpu0

    def hold_replica(self, wire: dict[str, Any]) -> None:
        cpu0 = time.thread_time()
        into = self._replica_spare(wire["key"].attempt, wire["flat"].size)
        from elastictrain.worker.snapshots.format import Snapshot

        self.store.add_replica(Snapshot.from_wire(wire, into=into))
        self.cpu_s["hold"] = time.thread_time() - cpu0

    def replica_address(self, host: str) -> dict[str, Any]:
        """Where the worker this one backs up sends its replicas: a socket on `host` (this node's
        address), opened at the first ask. Receiving one is this worker's `hold` cost."""
        if self._server is None:

            def keep(header: dict[str, Any], data: Any, cpu_s: float) -> None:
                from elastictrain.worker.snapshots.format import Snapshot

                self.store.add_replica(Snapshot.from_frame(header, data))
                self.cpu_s["hold"] = cpu_s

            self._server = ReplicaServer(
                host, keep, serve_pieces=self._serve_pieces, receive_into=self._replica_buffer
            )
        return self._server.address

    def _replica_spare(self, attempt: int, numel: int) -> Any:
        """Where an arriving replica (by socket or Ray call) is written: the spare replica's buffer, or
        None (a new one)."""
        spare = self.store.take_spare(own=False, attempt=attempt, numel=numel)
        return spare.buffer if spare is not None else None

    def _replica_buffer(self, header: dict[str, Any], numel: int) -> Any:
        into = self._replica_spare(int(header["key"][0]), numel)  # the socket reads into a numpy array
        return into.numpy() if into is not None else None

    def _serve_pieces(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """A load's request over the socket: the tensors it names of a snapshot this worker holds."""
        return pieces_answer(self.pieces(SnapshotKey(*request["key"]), request["keys"]))

    def report(self) -> dict[str, Any]:
        return {
            "copy_s": self.last_copy_s,
            "replicate_s": self.last_replicate_s,
            "cpu_s": sum(self.cpu_s.values()),  # what one snapshot costs this worker's process in CPU
            "held_bytes": self.store.nbytes(),
            "off": self.off,
            "replica_transport": self._link.transport if self._link is not None else None,
        }

    # -- served to peers (the replica concurrency group) --
    def meta(self, key: SnapshotKey) -> dict[str, Any]:
        return self.store.get(key).meta()

    def pieces(self, key: SnapshotKey, keys: list[str]) -> dict[str, Any]:
        tensors = self.store.get(key).tensors
        return {k: tensors[k].numpy() for k in keys}

    # -- loading a new attempt --
    def load(self, engine: Any, source: MemorySource) -> None:
        """Fill this rank's slices from the old ranks' snapshots, wherever they are held."""
        from elastictrain.worker.snapshots.load import load_from_holders

        self.last_fetch_s = load_from_holders(self, engine, source)
