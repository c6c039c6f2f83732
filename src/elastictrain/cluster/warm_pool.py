"""Workers a finished run leaves warm for the next run its driver starts (scaling.keep_warm_s).

A driver that trains again (a sweep, a notebook calling `fit` again, a test suite) would otherwise
start every worker anew: a process, then seconds of CPU importing torch, transformers and DeepSpeed
and loading compiled ops, per worker and per run. With scaling.keep_warm_s > 0 a run's end parks its
warm workers here with their reservations (whole placement groups), and the next run of the same
driver asking for the same resources takes them back: each left its run (`TrainWorker.leave_run`:
no engine, no snapshot, no fault, no data) and only loads the new run's data. A reservation holds a
tensor-parallel replica's ranks on one node: a run of the same degree takes it whole, and a run without
tensor parallelism takes each of its ranks as a replica of its own (a sweep over degrees keeps its
workers). A worker hosting a subclass of the class a run hosts serves it (it is one): the workers of a
chaos run (FaultyTrainWorker, faults disarmed when it left) serve the plain runs after it.

Parked workers keep their slots (CPUs, GPUs) reserved, so the pool gives them back to the cluster
`keep_warm_s` after the last park, when a run asks for other resources, and when the driver
disconnects from Ray. Everything here runs in the driver.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

log = logging.getLogger("elastictrain.workers")


@dataclass
class ParkedReservation:
    """One placement group and the warm actors in its bundles (a tensor-parallel replica: several)."""

    pg: PlacementGroup
    ready_ref: Any  # its resolved `ready()`: the reservation stands
    actors: dict[int, Any] = field(default_factory=dict)  # bundle -> actor
    cpus: float = 0.0
    gpus: float = 0.0
    hosts: dict[int, type] = field(default_factory=dict)  # bundle -> the class its actor hosts

    @property
    def ranks(self) -> int:
        """Its bundles, each with a warm worker (only whole reservations are parked)."""
        return len(self.actors)

    def serves(self, ranks: int) -> bool:
        """Whether a run whose replicas have `ranks` ranks can use it: whole, or one replica a bundle."""
        return ranks in (1, self.ranks)

    def hosts_a(self, cls: type) -> bool:
        """Whether every actor of it is a `cls` (hosts it or a subclass of it)."""
        return all(issubclass(h, cls) for h in self.hosts.values())


@dataclass
class _Pool:
    key: tuple[Any, ...] | None = None  # the cluster, the job and what the workers were started with
    parked: list[ParkedReservation] = field(default_factory=list)
    timer: threading.Timer | None = None


_pool = _Pool()
_lock = threading.Lock()


def _cluster() -> tuple[str, str] | None:
    """This driver's cluster and job, or None when it is not connected (parked handles are void)."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    return (str(ctx.gcs_address), str(ctx.get_job_id()))


def pool_key(*what: Any) -> tuple[Any, ...] | None:
    """The key parked workers are taken back by: this cluster and job, and `what` they were started
    with (their resources and environment)."""
    cluster = _cluster()
    return None if cluster is None else (*cluster, *what)


def park(key: tuple[Any, ...] | None, reservations: list[ParkedReservation], keep_s: float) -> None:
    """Keep `reservations` for the next run asking with `key`, for `keep_s` seconds."""
    if key is None or not reservations:
        _release(reservations)
        return
    with _lock:
        if _pool.key != key:
            _release_locked()
            _pool.key = key
        _pool.parked.extend(reservations)
        if _pool.timer is not None:
            _pool.timer.cancel()
        _pool.timer = threading.Timer(keep_s, release_all)
        _pool.timer.daemon = True
        _pool.timer.start()
    log.info("%d warm worker(s) kept for %gs for this driver's next run", count(), keep_s)


def take(
    key: tuple[Any, ...] | None, replicas: int, ranks: int = 1, hosts: type = object
) -> list[ParkedReservation]:
    """Parked reservations started with `key`, hosting `hosts` (or a subclass), for up to `replicas`
    replicas of `ranks` ranks each (a reservation serves one such replica, or one a bundle when `ranks`
    is 1). Parked ones started otherwise, or of replicas this run cannot use, are given back to the
    cluster (this run may need their slots)."""
    with _lock:
        if key is None or _pool.key != key:
            _say_given_back(_pool.parked, _difference(_pool.key, key))
            _release_locked()
            return []
        other_class = [r for r in _pool.parked if not r.hosts_a(hosts)]
        if other_class:
            then = " or ".join(
                sorted({_name(h) for r in other_class for h in r.hosts.values()} - {_name(hosts)})
            )
            _say_given_back(other_class, f"{then!r} then, {_name(hosts)!r} now")
            _release(other_class)
        unusable = [r for r in _pool.parked if r.hosts_a(hosts) and not r.serves(ranks)]
        if unusable:
            then = " or ".join(str(n) for n in sorted({r.ranks for r in unusable}))
            _say_given_back(unusable, f"replicas of {then} ranks then, {ranks} now")
            _release(unusable)
        taken: list[ParkedReservation] = []
        kept: list[ParkedReservation] = []
        for r in (r for r in _pool.parked if r.hosts_a(hosts) and r.serves(ranks)):
            if replicas > 0:
                taken.append(r)
                replicas -= r.ranks // ranks
            else:
                kept.append(r)
        _pool.parked = kept
        if not _pool.parked and _pool.timer is not None:
            _pool.timer.cancel()
            _pool.timer = None
        if taken:
            log.info("%d warm worker(s) of this driver's last run taken", sum(r.ranks for r in taken))
        return taken


def _say_given_back(reservations: list[ParkedReservation], why: str) -> None:
    """Say that `reservations` go back to the cluster, and why (they are released by the caller)."""
    if reservations:
        log.info(
            "%d warm worker(s) of this driver's last run given back: this run starts its workers "
            "otherwise (%s)",
            sum(r.ranks for r in reservations),
            why,
        )


def _difference(parked: tuple[Any, ...] | None, wanted: tuple[Any, ...] | None) -> str:
    """What differs between the parked workers' key and the one a run asks with, in words."""
    if parked is None or wanted is None or parked[:2] != wanted[:2]:
        return "another cluster or job"
    return "; ".join(f"{a!r} then, {b!r} now" for a, b in zip(parked[2:], wanted[2:], strict=False) if a != b)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def parked_actors() -> list[Any]:
    """The parked workers' actor handles."""
    with _lock:
        return [a for r in _pool.parked for a in r.actors.values()]


def count() -> int:
    """How many warm workers are parked."""
    return len(parked_actors())


def reserved() -> dict[str, float]:
    """The resources parked workers hold: free for this driver's next run, not for anyone else."""
    with _lock:
        return {
            "CPU": sum(r.cpus for r in _pool.parked),
            "GPU": sum(r.gpus for r in _pool.parked),
        }


def release_all() -> None:
    """Give every parked worker's slot back to the cluster (the actors end)."""
    with _lock:
        _release_locked()


def _release_locked() -> None:
    parked, _pool.parked = _pool.parked, []
    if _pool.timer is not None:
        _pool.timer.cancel()
        _pool.timer = None
    current = _cluster()
    # Handles of another cluster or job (the driver reconnected) are void: forget them.
    if parked and _pool.key is not None and current == _pool.key[:2]:
        _release(parked)
    _pool.key = None


def kill_actor(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # noqa: BLE001 - already gone (its node, or the cluster)
        log.debug("kill a parked worker: %s", e)


def _release(reservations: list[ParkedReservation]) -> None:
    for r in reservations:
        for actor in r.actors.values():
            kill_actor(actor)
        try:
            remove_placement_group(r.pg)
        except Exception as e:  # noqa: BLE001 - already gone with its node
            log.debug("remove a parked reservation: %s", e)
