"""Ray side of the workers: reservations (placement groups), actors, and their liveness.

Each worker gets its own single-bundle placement group; with tensor parallelism (N ranks a replica)
each replica gets one placement group of N bundles packed on one node, the fast link its ranks need.
A lost node then releases exactly the workers it hosted, and a reservation that cannot be met yet
stays *pending*: the Ray autoscaler (and KubeRay) sees pending placement groups as demand and adds
nodes, which plain polling of free resources would never cause. When a pending reservation becomes
ready, capacity has returned. A worker lost from a replica whose node lives on gives its bundle back
as a pending slot: its replacement starts there, beside the replica's survivors.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastictrain.cluster import warm_pool
from elastictrain.cluster.allocator import jemalloc_library
from elastictrain.cluster.calls import DIED, NODE_LOST, Calls, Reply, WorkerViews
from elastictrain.cluster.ray_replies import gather_replies
from elastictrain.cluster.worker_api import WorkerApi, WorkerMethod, method_name
from elastictrain.cluster.worker_resources import WorkerResources
from elastictrain.worker.actor import TrainWorker

# How long a run's end waits for its workers to leave the run before parking them (scaling.keep_warm_s);
# one that has not left by then (a hung step) ends instead.
LEAVE_RUN_TIMEOUT_S = 30.0
LOADING_LEAVE_S = 5.0  # how long a run's end waits for a reused spare still loading its data
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id

log = logging.getLogger("elastictrain.workers")


@dataclass
class WorkerHandle:
    worker_id: str
    actor: Any
    pg: PlacementGroup
    info: dict[str, Any] = field(default_factory=dict)
    bundle: int = 0  # its bundle in pg (a replica's placement group holds one per rank)
    warm_ref: Any = None  # the pending `warmup` call; None once it finished
    warm: bool = False
    hosts: type = object  # the class its actor hosts (a parked worker keeps its own: cluster/warm_pool.py)
    reused: bool = False  # an earlier run's parked worker: its warm-up only loads this run's data

    @property
    def actor_id(self) -> str:
        return str(self.info.get("actor_id", ""))

    @property
    def node_id(self) -> str:
        return str(self.info.get("node_id", ""))


@dataclass(frozen=True)
class Slot:
    """One worker's place in a reservation: bundle `bundle` of placement group `pg`."""

    pg: PlacementGroup
    bundle: int


class WorkerGroup(WorkerViews):
    def __init__(
        self,
        resources: WorkerResources,
        name_prefix: str = "et",
        *,
        keep_warm_s: float = 0.0,
        reuse_warm: bool = True,
        worker_class: type | None = None,
    ) -> None:
        """Workers start from those an earlier run of this driver left warm, started alike, unless
        `reuse_warm` is False (cluster/warm_pool.py); `keep_warm_s` > 0: they are left warm at the end
        for that long. `worker_class`: what each actor hosts instead of TrainWorker (tests' and chaos
        runs' FaultyTrainWorker); parked workers serve a group that hosts their class or a base of it."""
        self.resources = resources
        self.keep_warm_s = keep_warm_s
        self.reuse_warm = reuse_warm
        # Who may take parked workers: what decides a worker process's start (resources, environment).
        # Parked reservations of any tensor-parallel degree may serve this group (warm_pool.take).
        started_alike = replace(resources, ranks_per_reservation=1, replica_spans_nodes=False)
        self._hosted: type = worker_class or TrainWorker
        self._pool_key = warm_pool.pool_key(started_alike, tuple(sorted(resources.env_vars().items())))
        # (placement group, bundle) -> a parked actor and the class it hosts
        self._parked: dict[tuple[str, int], tuple[Any, type]] = {}
        self.workers: list[WorkerHandle] = []
        self.pending: list[Slot] = []
        self._ready_refs: dict[str, Any] = {}  # placement group id -> its one `ready()` ref
        self._ids = itertools.count()
        self._prefix = name_prefix
        # "replica" (worker/ray_calls.py): buddies' snapshots arrive and are served beside training.
        self._actor_cls = ray.remote(concurrency_groups={"control": 2, "replica": 2, "watch": 2})(
            self._hosted
        )
        self.warmup_errors: list[tuple[str, str]] = []  # warm-ups that raised (the loop may end the run)
        self._allocator_warned = False
        self._avoid: dict[str, float] = {}  # node id -> until when new reservations stay off it
        self._avoiding: dict[str, float] = {}  # reservations made off avoided nodes -> when that ends

    # -- reservations --
    def request(self, n: int) -> None:
        """Ask for n more worker slots (whole replicas of them); they stay pending until the cluster
        can place them."""
        size = self.resources.ranks_per_reservation
        wanted = -(-n // size)
        if not self.reuse_warm:
            warm_pool.release_all()  # their slots may be what this group needs
        else:
            for parked in warm_pool.take(self._pool_key, wanted, size, self._hosted):
                # Whole, as a replica of this group's degree, or (size 1) one replica a bundle.
                self.pending.extend(Slot(parked.pg, b) for b in sorted(parked.actors))
                self._ready_refs[parked.pg.id.hex()] = parked.ready_ref
                self._parked.update(
                    {(parked.pg.id.hex(), b): (a, parked.hosts[b]) for b, a in parked.actors.items()}
                )
                wanted -= parked.ranks // size
        for _ in range(wanted):
            self._reserve(size)

    def _reserve(self, size: int) -> None:
        """One reservation of `size` slots, off the nodes avoided now."""
        now = time.monotonic()
        avoided = sorted(n for n, until in self._avoid.items() if until > now)
        selector = [{NODE_ID_LABEL: f"!in({','.join(avoided)})"}] * size if avoided else None
        strategy = "PACK" if self.resources.replica_spans_nodes else "STRICT_PACK"
        pg = placement_group(
            [self.resources.bundle()] * size, strategy=strategy, bundle_label_selector=selector
        )
        self.pending.extend(Slot(pg, i) for i in range(size))
        self._ready_refs[pg.id.hex()] = pg.ready()
        if avoided:
            self._avoiding[pg.id.hex()] = max(self._avoid[n] for n in avoided)

    def avoid_node(self, node_id: str, seconds: float) -> None:
        """New reservations stay off `node_id` for `seconds` (a straggler's node); one still waiting when
        that ends is asked for again without the restriction."""
        self._avoid[node_id] = time.monotonic() + seconds

    def _renew_expired_avoidance(self) -> None:
        now = time.monotonic()
        for key, until in list(self._avoiding.items()):
            if until > now:
                continue
            del self._avoiding[key]
            slots = [s for s in self.pending if s.pg.id.hex() == key]
            ready, _ = ray.wait([self._ready_refs[key]], timeout=0) if slots else ([], [])
            if slots and not ready:  # still waiting: the avoided node may be the only room
                for slot in slots:
                    self.pending.remove(slot)
                self._drop_if_unused(slots[0].pg)
                self._reserve(len(slots))

    def _ready(self, timeout_s: float, n: int | None = None) -> list[Slot]:
        """Pending slots whose reservation is placed, after waiting up to timeout_s for n slots."""
        if self._avoiding:
            self._renew_expired_avoidance()
        if not self.pending:
            return []
        groups = list({slot.pg.id.hex(): slot.pg for slot in self.pending}.values())
        refs = [self._ready_refs[pg.id.hex()] for pg in groups]
        slots_per = {pg.id.hex(): sum(s.pg is pg for s in self.pending) for pg in groups}
        want = len(refs) if n is None else max(1, min(-(-n // max(slots_per.values())), len(refs)))
        ray.wait(refs, num_returns=want, timeout=timeout_s)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        placed = {pg.id.hex() for pg, ref in zip(groups, refs, strict=True) if ref in done}
        return [slot for slot in self.pending if slot.pg.id.hex() in placed]

    def ready_reservations(self, timeout_s: float = 0.0) -> int:
        """How many pending slots are placed now (waits up to timeout_s for all of them)."""
        return len(self._ready(timeout_s))

    def wait_for_reservations(self, n: int, timeout_s: float) -> int:
        """Wait until n pending slots are placed or the timeout passes; returns how many are."""
        return len(self._ready(timeout_s, n))

    def release_pending(self, keep: int = 0) -> None:
        while len(self.pending) > keep:
            slot = self.pending.pop()
            self._drop_if_unused(slot.pg)

    def _drop_if_unused(self, pg: PlacementGroup) -> None:
        """Remove a placement group no worker and no pending slot uses any more."""
        if any(w.pg is pg for w in self.workers) or any(s.pg is pg for s in self.pending):
            return
        self._ready_refs.pop(pg.id.hex(), None)
        for key in [k for k in self._parked if k[0] == pg.id.hex()]:  # parked there, never started
            warm_pool.kill_actor(self._parked.pop(key)[0])
        try:
            remove_placement_group(pg)
        except Exception as e:  # noqa: BLE001 - already gone with its node
            log.debug("remove placement group %s: %s", pg.id.hex(), e)

    # -- actors --
    def start_workers(self, limit: int, config: Any) -> list[WorkerHandle]:
        """Start actors in up to `limit` placed slots; they warm up in the background."""
        new: list[WorkerHandle] = []
        for slot in self._ready(0.0)[:limit]:
            self.pending.remove(slot)
            worker_id = f"{self._prefix}-w{next(self._ids)}"
            parked = self._parked.pop((slot.pg.id.hex(), slot.bundle), None)
            if parked is not None:  # a finished run's warm worker: its process and imports are ready
                actor, hosts = parked
                warm_ref = actor.warmup.remote(config, worker_id)
            else:
                log.debug("%s starts cold: a new process, its imports and compiled ops", worker_id)
                actor, hosts = self._new_actor(slot, worker_id), self._hosted
                warm_ref = actor.warmup.remote(config)
            handle = WorkerHandle(
                worker_id,
                actor,
                slot.pg,
                warm_ref=warm_ref,
                bundle=slot.bundle,
                hosts=hosts,
                reused=parked is not None,
            )
            new.append(handle)
        self.workers.extend(new)
        return new

    def _new_actor(self, slot: Slot, worker_id: str) -> Any:
        strategy = PlacementGroupSchedulingStrategy(slot.pg, placement_group_bundle_index=slot.bundle)
        return self._actor_cls.options(
            num_cpus=self.resources.cpus_per_worker,
            num_gpus=self.resources.gpus_per_worker if self.resources.use_gpu else 0,
            scheduling_strategy=strategy,
            runtime_env={"env_vars": self.resources.env_vars()},
            max_restarts=0,
        ).remote(worker_id, self.resources.use_gpu)

    def poll_warm(self, timeout_s: float = 0.0, n: int | None = None) -> list[WorkerHandle]:
        """Collect finished warm-ups (waiting up to timeout_s for n of them); a failed one is removed."""
        cold = self.warming
        if not cold:
            return []
        refs = [w.warm_ref for w in cold]
        want = len(refs) if n is None else max(1, min(n, len(refs)))
        ready, _ = ray.wait(refs, num_returns=want, timeout=timeout_s)
        done = set(ready)
        became_warm = []
        for w in cold:
            if w.warm_ref not in done:
                continue
            try:
                w.info = ray.get(w.warm_ref)
                w.warm, w.warm_ref = True, None
                self._check_allocator(w)
                became_warm.append(w)
            except Exception as e:  # noqa: BLE001 - a worker that cannot warm up is not usable
                log.warning("worker %s failed to start: %s", w.worker_id, e)
                if isinstance(e, RayTaskError):  # the warm-up raised (not a dead actor): its own error
                    cause = getattr(e, "cause", None)
                    self.warmup_errors.append((w.worker_id, str(cause if cause is not None else e)))
                self.remove(w)
        return became_warm

    def _check_allocator(self, w: WorkerHandle) -> None:
        running = w.info.get("allocator", self.resources.allocator)
        if running != self.resources.allocator and not self._allocator_warned:
            self._allocator_warned = True
            log.warning(
                "worker %s on node %s runs the %s malloc, not scaling.worker_allocator=%s (%s): "
                "its ranks keep more freed memory resident",
                w.worker_id,
                w.info.get("node_ip", "?"),
                running,
                self.resources.allocator,
                jemalloc_library() or "Ray ships no libjemalloc.so here",
            )

    def remove(self, handle: WorkerHandle, *, kill: bool = True) -> None:
        if handle in self.workers:
            self.workers.remove(handle)
        if kill:
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead is fine
                log.debug("kill %s: %s", handle.worker_id, e)
        if any(w.pg is handle.pg for w in self.workers):
            # The rest of its replica lives on: its replacement starts in this bundle, on their node.
            self.pending.append(Slot(handle.pg, handle.bundle))
            return
        self.pending = [s for s in self.pending if s.pg is not handle.pg]
        self._drop_if_unused(handle.pg)

    def progress(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any] | None]:
        refs = {
            w.worker_id: w.actor.progress.options(concurrency_group="control").remote() for w in self.workers
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out: dict[str, dict[str, Any] | None] = {}
        for wid, ref in refs.items():
            try:
                out[wid] = ray.get(ref) if ref in ready else None
            except Exception:  # noqa: BLE001
                out[wid] = None
        return out

    # -- calls --
    def call(
        self,
        workers: Sequence[WorkerHandle],
        method: WorkerMethod,
        *args: Any,
        control: bool = False,
        watch: bool = False,
    ) -> Calls:
        calls: Calls = {}
        lane = "control" if control else "watch" if watch else None
        name = method_name(method)
        for w in workers:
            fn = getattr(w.actor, name)
            calls[w.worker_id] = (fn.options(concurrency_group=lane) if lane else fn).remote(*args)
        return calls

    def call_each(
        self, workers: Sequence[WorkerHandle], method: WorkerMethod, args: Sequence[tuple[Any, ...]]
    ) -> Calls:
        name = method_name(method)
        return {w.worker_id: getattr(w.actor, name).remote(*a) for w, a in zip(workers, args, strict=True)}

    def gather(
        self,
        calls: Calls,
        timeout_s: float,
        *,
        stop_on_error: bool = False,
        grace_s: float = 3.0,
    ) -> dict[str, Reply]:
        replies = gather_replies(calls, timeout_s, stop_on_error=stop_on_error, grace_s=grace_s)
        return self._mark_lost_nodes(replies)

    def _mark_lost_nodes(self, replies: dict[str, Reply]) -> dict[str, Reply]:
        if not any(r.error == DIED for r in replies.values()):
            return replies
        alive = self.nodes_alive()
        node_of = {w.worker_id: w.node_id for w in self.workers}
        out = {}
        for wid, r in replies.items():
            node = node_of.get(wid, "")
            lost = r.error == DIED and wid in node_of and node not in alive
            out[wid] = replace(r, error=NODE_LOST, node_id=node) if lost else replace(r, node_id=node)
        return out

    def nodes_alive(self) -> set[str]:
        return {str(n.get("NodeID")) for n in ray.nodes() if n.get("Alive")}

    def shutdown(self) -> None:
        if self.keep_warm_s > 0:
            self._park_warm_workers()
        for w in list(self.workers):
            self.remove(w)
        self.release_pending()

    def _park_warm_workers(self) -> None:
        """Leave the warm workers' reservations to this driver's next run (cluster/warm_pool.py): each
        whole placement group, every bundle of it holding a worker that left the run in time or the warm
        worker an earlier run parked there and this one never started (a run of fewer ranks than the
        replicas it took: TP 1 x DP 3 on two parked replicas of 2 leaves both whole)."""
        # A reused worker still loading this run's data (a spare the run ended first) is kept too if that
        # ends soon: its calls run in order, so it leaves the run after.
        leaving = self.call(self.warm_workers, WorkerApi.leave_run)
        loading = self.call([w for w in self.warming if w.reused], WorkerApi.leave_run)
        left = self.gather(leaving, LEAVE_RUN_TIMEOUT_S) | self.gather(loading, LOADING_LEAVE_S)
        groups = {w.pg.id.hex(): w.pg for w in self.workers} | {s.pg.id.hex(): s.pg for s in self.pending}
        parked: list[warm_pool.ParkedReservation] = []
        for pg_id, pg in groups.items():
            workers = [w for w in self.workers if w.pg.id.hex() == pg_id]
            unstarted = {b: kept for (kept_in, b), kept in self._parked.items() if kept_in == pg_id}
            to_start_cold = any(
                s.pg.id.hex() == pg_id and (pg_id, s.bundle) not in self._parked for s in self.pending
            )
            whole = len(workers) + len(unstarted) == pg.bundle_count and not to_start_cold
            if not whole or not all(w.worker_id in left and left[w.worker_id].ok for w in workers):
                continue
            for w in workers:
                self.workers.remove(w)
            self.pending = [s for s in self.pending if s.pg.id.hex() != pg_id]
            actors = {w.bundle: (w.actor, w.hosts) for w in workers} | unstarted
            for bundle in unstarted:
                del self._parked[(pg_id, bundle)]
            parked.append(
                warm_pool.ParkedReservation(
                    pg,
                    self._ready_refs.pop(pg_id),
                    {b: actor for b, (actor, _) in actors.items()},
                    cpus=self.resources.cpus_per_worker * len(actors),
                    gpus=self.resources.gpus_per_worker * len(actors) if self.resources.use_gpu else 0.0,
                    hosts={b: hosts for b, (_, hosts) in actors.items()},
                )
            )
        warm_pool.park(self._pool_key, parked, self.keep_warm_s)
