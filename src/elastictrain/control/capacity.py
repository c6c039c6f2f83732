"""Capacity and growth: how many warm workers the next attempt gets, and when to grow into more."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from elastictrain.cluster.calls import Group
from elastictrain.config.pipeline_check import fixed_stages
from elastictrain.control.errors import RunFailed
from elastictrain.control.record import RunRecorder
from elastictrain.core.batch import BatchPlan
from elastictrain.core.policy import (
    Fail,
    Restart,
    ScalingRules,
    Wait,
    ceiling_after_out_of_memory,
    decide_grow,
    decide_start,
    repeated_warmup_error,
)
from elastictrain.core.replicas import size_and_degree, usable_workers
from elastictrain.core.state import RunStatus

FIRST_PLACEMENT_WAIT_S = 5.0  # at the first start, time for the reservations to be placed
QUICK_PLACEMENT_S = 1.0  # ample for a reservation the cluster has room for to be placed
WARMUP_POLL_S = 1.0


def scaling_rules(config: Any) -> ScalingRules:
    s = config.scaling
    return ScalingRules(
        min_workers=s.min_workers,
        max_workers=s.max_workers,
        global_batch_size=config.training.global_batch_size,
        micro_batch_size=config.training.micro_batch_size,
        max_failures=config.failure.max_failures,
        wait_for_capacity_s=config.failure.wait_for_capacity_s,
        tensor_parallel=s.tensor_parallel,
        pipeline_parallel=fixed_stages(config),
    )


class Capacity:
    def __init__(
        self,
        config: Any,
        group: Group,
        recorder: RunRecorder,
        *,
        clock: Callable[[], float] = time.monotonic,
        degrees: Any = None,
        layouts: Any = None,
        stages: Any = None,
    ) -> None:
        self.cfg = config
        self.group = group
        self.recorder = recorder
        self.rules = scaling_rules(config)
        self.clock = clock
        self.degrees = degrees  # tensor_parallel: auto's chooser (tensor_parallel_auto.py), or None
        self.layouts = layouts  # auto layout fields' chooser (driver/layout_auto.py), or None
        self.stages = stages  # pipeline_parallel: auto's chooser (driver/pipeline_auto.py), or None
        self._stages_now = 0  # the stages of the last attempt under pipeline_parallel: auto
        self._warming_since: dict[str, float] = {}  # worker id -> when it was started
        self._warm_up_s: list[float] = []  # how long the finished warm-ups took (as noticed)

    def _restart_size(self, step: int) -> int | None:
        """The warm workers' best world size; with `tensor_parallel: auto`, at the degree that fits there."""
        if self.degrees is None:
            return self.rules.best_size(self.usable_warm())
        nodes = [w.node_id for w in self.group.warm_workers]
        choice = size_and_degree(
            self.rules, self.degrees.candidates, lambda n: usable_workers(nodes, n), self.degrees.fits
        )
        if choice is None:
            return None
        n, size, why = choice
        if n != self.rules.tensor_parallel:
            self.rules = replace(self.rules, tensor_parallel=n)
            self.recorder.event(
                "tensor_parallel", f"scaling.tensor_parallel=auto: {why}", step=step, tensor_parallel=n
            )
        return size

    def layout_plan(self, size: int, step: int) -> BatchPlan:
        """The batch split of an attempt of `size`; with auto layout fields, after choosing them for that
        world size (the run's config takes the choice; a change is an event). Nothing fitting ends the run."""
        if self.layouts is not None:
            choice = self.layouts.choose(size, self.rules.tensor_parallel)
            if not choice.fits:
                raise RunFailed(
                    f"auto layout: nothing fits at world size {size}: "
                    + "; ".join(choice.lines())
                    + f"; the last checkpoint stays; `elastictrain resume {self.recorder.run_dir.path}` "
                    "with more ranks or memory"
                )
            self.rules = replace(self.rules, micro_batch_size=choice.layout.micro_batch_size)
            if self.layouts.apply(choice):  # the start chose for min_workers
                head, estimate = choice.lines()
                self.recorder.event(
                    "layout", f"{head}; {estimate}", step=step, world_size=size, **asdict(choice.layout)
                )
        rules = self.rules
        if self.stages is not None:
            stages, why = self.stages.choose(size)
            if stages != self._stages_now:
                self._stages_now = stages
                self.recorder.event(
                    "pipeline_parallel", why, step=step, world_size=size, pipeline_parallel=stages
                )
            rules = replace(rules, pipeline_parallel=stages)
        plan = rules.plan(size)
        assert plan is not None
        return plan

    def usable_warm(self) -> int:
        """Warm workers that can take part: with tensor parallelism, whole replicas on each node (a
        pipeline replica's stages may span nodes)."""
        nodes = [w.node_id for w in self.group.warm_workers]
        return usable_workers(nodes, self.rules.tensor_parallel)

    def slots(self) -> int:
        """Workers that exist plus reservations placed: what a restart could run on."""
        return len(self.group.workers) + self.group.ready_reservations()

    def tend_workers(self, step: int) -> None:
        """Between steps: stop warm-ups that overran failure.warmup_timeout_s, start actors in placed
        reservations."""
        if self.group.warming:
            self.stop_stuck_warmups(step)
        if self.group.pending:
            self.start_new_workers(step)

    def stop_stuck_warmups(self, step: int) -> None:
        """A worker warming up for longer than failure.warmup_timeout_s and three times the longest warm-up
        that finished (an import, an op build or a placement that never ends, while the others' ended) is
        named and stopped; its slot is asked for again. While none has finished, warm-ups slow alike (a
        large dataset to tokenize) get three timeouts before they are taken as stuck."""
        now = self.clock()
        for wid, since in list(self._warming_since.items()):
            if any(w.worker_id == wid for w in self.group.warm_workers):
                self._warm_up_s.append(now - since)
                del self._warming_since[wid]
        timeout = float(self.cfg.failure.warmup_timeout_s)
        # None finished yet: slow alike for three timeouts is taken as stuck alike too, so none waits forever.
        limit = max(timeout, 3 * max(self._warm_up_s)) if self._warm_up_s else 3 * timeout
        stopped = False
        for w in list(self.group.warming):
            since = self._warming_since.setdefault(w.worker_id, now)
            if now - since <= limit:
                continue
            self.group.remove(w)
            self._warming_since.pop(w.worker_id, None)
            stopped = True
            self.recorder.event(
                "warmup_timeout",
                f"worker {w.worker_id} did not finish starting in {limit:.0f}s (failure.warmup_timeout_s; "
                "3x the slowest finished start, or 3x the timeout while none has): stopped; a new worker "
                "starts in its place",
                style="yellow",
                step=step,
                worker=w.worker_id,
                seconds=round(now - since, 1),
            )
        if stopped:
            self._request_missing()

    def start_new_workers(self, step: int) -> None:
        """Start actors in every placed reservation; they warm up while the others train."""
        new = self.group.start_workers(self.actors_wanted, self.cfg)
        now = self.clock()
        self._warming_since.update((w.worker_id, now) for w in new)
        if new:
            self.recorder.event(
                "workers_starting",
                f"starting {len(new)} worker actor(s) in the background",  # warm ones: warm_pool logs it
                step=step,
                workers=[w.worker_id for w in new],
            )

    @property
    def actors_wanted(self) -> int:
        """The largest world size's workers and the spares beside them."""
        return self.rules.max_workers + self.cfg.scaling.spare_workers

    def _request_missing(self) -> None:
        missing = self.actors_wanted - len(self.group.workers) - len(self.group.pending)
        if missing > 0:
            self.group.request(missing)

    def acquire(self, *, initial: bool, step: int) -> int:
        """The world size of the next attempt, once that many warm workers are there.

        After a failure, the warm survivors restart at once (shrinking if need be) and replacements
        warm up in the background, joining by a grow at a later checkpoint: a cold actor is on the
        critical path only at the first start or below the minimum size.
        """
        self._request_missing()
        if initial:
            self._first_placement(step)
        waiting_since: float | None = None
        announced = None
        while True:
            self.stop_stuck_warmups(step)
            self.start_new_workers(step)
            self.group.poll_warm()
            self._fail_on_repeated_warmup_error()
            if not initial:
                size = self._restart_size(step)
                if size is not None:
                    return size
            capacity = self.slots()  # read once: a reservation may be placed at any moment
            decision = decide_start(self.rules, capacity, self.clock(), waiting_since)
            if isinstance(decision, Restart):
                # Enough workers exist but some are still warming up: wait for them.
                need = decision.world_size - self.usable_warm()
                if need <= 0:
                    if waiting_since is not None:
                        self.recorder.event(
                            "capacity_back", f"{decision.world_size} workers ready", step=step
                        )
                    return decision.world_size
                self.group.poll_warm(timeout_s=WARMUP_POLL_S, n=need)
                self._fail_on_repeated_warmup_error()
                continue
            if isinstance(decision, Fail):
                raise RunFailed(decision.reason)
            assert isinstance(decision, Wait)
            if waiting_since is None:
                waiting_since = self.clock()
                self.recorder.set_status(RunStatus.WAITING, decision.reason, step=step)
            if announced != decision.reason:
                self.recorder.event(
                    "waiting_for_capacity",
                    f"waiting up to {decision.deadline - self.clock():.0f}s for capacity: {decision.reason}",
                    style="yellow",
                    step=step,
                    need=decision.need,
                )
                announced = decision.reason
            self.group.wait_for_reservations(decision.need - len(self.group.workers), timeout_s=1.0)

    def _first_placement(self, step: int) -> None:
        """At the first start, give every reservation up to FIRST_PLACEMENT_WAIT_S to be placed, so the
        run starts at its largest size; the actors of those placed at once start warming up first, so
        waiting for one the cluster cannot place (max_workers above its CPUs) costs no time."""
        self.group.wait_for_reservations(len(self.group.pending), QUICK_PLACEMENT_S)
        if self.group.pending:
            self.start_new_workers(step)
            self.group.wait_for_reservations(
                len(self.group.pending), FIRST_PLACEMENT_WAIT_S - QUICK_PLACEMENT_S
            )

    def _fail_on_repeated_warmup_error(self) -> None:
        """Waiting for workers whose warm-up raises the same error each time would only spin."""
        reason = repeated_warmup_error(self.group.warmup_errors)
        if reason:
            raise RunFailed(f"{reason}; fix it, then `elastictrain resume {self.recorder.run_dir.path}`")

    def lower_ceiling(self, world_size: int, step: int) -> None:
        """A worker was killed for memory at `world_size`: the run goes on below it (or ends, saying why)."""
        lowered = ceiling_after_out_of_memory(self.rules, world_size)
        if isinstance(lowered, Fail):
            raise RunFailed(lowered.reason)
        self.rules = lowered
        self.recorder.event(
            "memory_ceiling",
            f"a worker ran out of memory at world size {world_size}: the run goes on at "
            f"{lowered.max_workers} workers at most (scaling.max_workers={self.cfg.scaling.max_workers} "
            "again after `elastictrain resume`)",
            style="yellow",
            step=step,
            max_workers=lowered.max_workers,
        )

    def grow_target(self, world_size: int, step: int) -> int | None:
        """A larger world size to move to now (warm workers for it are there), or None."""
        if world_size >= self.rules.max_workers:
            return None
        self._request_missing()
        self.stop_stuck_warmups(step)
        self.start_new_workers(step)
        self.group.poll_warm()
        return decide_grow(self.rules, world_size, self.usable_warm())
