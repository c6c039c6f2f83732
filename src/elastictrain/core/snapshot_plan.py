"""Recovering from the workers' memory: who backs up whom, and which in-memory snapshot a restart loads.

Every rank keeps a host copy of its slice of the state after each `checkpoint.memory_every_steps`
step, and a buddy worker (on another node when there is one) holds a replica of it. After a failure
the survivors report what they hold; a snapshot step is usable when every rank of the failed world
has its slice at that step on some survivor. Decisions over names and numbers only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

KEEP = 2  # complete snapshots a worker keeps of its own rank, and of the rank whose buddy it is
# Buffers of one rank's slice a worker holds: KEEP own and the one being copied, KEEP replicas and the
# one arriving. Each new copy or replica is written into the buffer of the oldest one it replaces, so
# these are all, whatever malloc keeps of freed memory, and no copy pays a new buffer's page faults. A
# disk checkpoint writes the own copy of its step, never another; a checkpoint at a step without one
# copies only into what this count leaves of the budget (else it streams from the live state).
OWN_SLICES = KEEP + 1
SLICES_HELD = 2 * OWN_SLICES
MAX_INTERVAL = 1000  # steps: snapshots this rare are not worth their memory; the cost rule stops here


@dataclass(frozen=True)
class SnapshotKey:
    """Which snapshot: of `rank` in attempt `attempt` (of `world_size` ranks), the state after `step`."""

    attempt: int
    world_size: int
    rank: int
    step: int  # the state after this many optimizer steps


@dataclass(frozen=True)
class Held:
    """One rank's slice at one step, held by `worker_id` (its own copy, or a buddy's replica)."""

    worker_id: str
    attempt: int
    world_size: int
    rank: int
    step: int
    own: bool = True  # the rank's own worker (False: a buddy's replica)


@dataclass(frozen=True)
class MemoryPlan:
    """Load the state after `step` steps from the snapshots of attempt `attempt` (at `world_size`)."""

    attempt: int
    world_size: int
    step: int
    holders: dict[int, str]  # old rank -> the worker that serves its slice


@dataclass(frozen=True)
class MemoryChoice:
    plan: MemoryPlan | None
    reason: str  # why memory cannot be used (plan is None), or where the slices come from


def assign_buddies(nodes: Sequence[str]) -> list[int | None]:
    """For each rank (its node id given), the rank that holds its replica; None at world size 1.

    Ranks are lined up node by node and each is backed up by the rank `m` places further round the
    ring, `m` the most ranks any node has: a node's ranks sit within `m` consecutive places, so
    while no node holds more than half of the ranks every buddy is on another node (`off_node`
    says whether that holds). On one node the buddy is simply the next worker.
    """
    n = len(nodes)
    if n < 2:
        return [None] * n
    order = sorted(range(n), key=lambda r: (nodes[r], r))
    counts: dict[str, int] = defaultdict(int)
    for node in nodes:
        counts[node] += 1
    shift = max(counts.values())
    if shift == n:  # one node: the next worker
        shift = 1
    buddies: list[int | None] = [None] * n
    for i, rank in enumerate(order):
        buddies[rank] = order[(i + shift) % n]
    return buddies


def off_node(nodes: Sequence[str], buddies: Sequence[int | None]) -> bool:
    """Whether every rank's buddy is on another node than the rank."""
    return all(b is not None and nodes[b] != nodes[r] for r, b in enumerate(buddies))


def choose_memory_snapshot(held: Iterable[Held], *, max_step: int, disk_step: int) -> MemoryChoice:
    """The newest in-memory snapshot that every rank of one world has on some survivor.

    `held` is what the surviving workers report; `max_step` the steps the controller has reported
    (a snapshot past it would skip steps nobody saw), `disk_step` the last committed checkpoint's
    step: memory is used when it is at least as new (same state, no disk read).
    """
    by_world: dict[tuple[int, int], dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    for h in held:
        if h.step > max_step or not 0 <= h.rank < h.world_size:
            continue
        holders = by_world[(h.attempt, h.world_size)][h.step]
        if h.rank not in holders or h.own:  # a rank's own copy is preferred: its worker has it locally
            holders[h.rank] = h.worker_id
    if not by_world:
        return MemoryChoice(None, f"no survivor holds an in-memory snapshot at or before step {max_step}")
    best: MemoryPlan | None = None
    for (attempt, world), steps in by_world.items():
        for step, holders in steps.items():
            if len(holders) == world and (best is None or (step, attempt) > (best.step, best.attempt)):
                best = MemoryPlan(attempt, world, step, dict(sorted(holders.items())))
    if best is None:
        return MemoryChoice(None, _why_incomplete(by_world))
    if best.step < disk_step:
        return MemoryChoice(
            None,
            f"the newest complete in-memory snapshot (step {best.step}) is older than the disk checkpoint",
        )
    sources = ", ".join(f"rank {r}: {w}" for r, w in best.holders.items())
    return MemoryChoice(best, f"every rank's slice at step {best.step} is in memory ({sources})")


def _why_incomplete(by_world: dict[tuple[int, int], dict[int, dict[int, str]]]) -> str:
    attempt, world = max(by_world)
    steps = by_world[(attempt, world)]
    newest = max(steps)
    missing = sorted(set(range(world)) - set(steps[newest]))
    per_rank: dict[int, list[int]] = defaultdict(list)
    for step, holders in steps.items():
        for rank in holders:
            per_rank[rank].append(step)
    if len(per_rank) == world:  # every rank has something, never at one common step
        held = "; ".join(f"rank {r}: steps {sorted(s)}" for r, s in sorted(per_rank.items()))
        return f"in-memory snapshots are inconsistent (ranks at different steps: {held})"
    lost = sorted(set(range(world)) - set(per_rank)) or missing
    return (
        f"rank(s) {lost} of world size {world} have no in-memory snapshot on any survivor "
        "(the rank and its buddy were both lost)"
    )


def snapshot_interval(cost_s: float, step_s: float, *, every: int, max_share: float) -> int:
    """Steps between in-memory snapshots (0: none): at least `every`, and far enough apart that one
    snapshot's cost (its copy and replication, `cost_s`) stays within `max_share` of the training time
    between two of them (`step_s` a step). `max_share` 0 keeps `every` whatever the cost."""
    if every <= 0:
        return 0
    if max_share <= 0 or cost_s <= 0 or step_s <= 0:
        return every
    return max(every, min(MAX_INTERVAL, math.ceil(cost_s / (max_share * step_s))))


# A measured share must exceed the allowed one by this factor before the interval grows, and fall this
# far below it at a shorter interval before it shrinks: between the two, noise moves nothing.
MARGIN = 1.5


@dataclass(frozen=True)
class IntervalChange:
    interval: int  # the new interval (steps between snapshots)
    share: float  # what snapshots cost at the old interval, as a share of training time


def next_interval(
    cost_s: float, step_s: float, *, interval: int, every: int, max_share: float
) -> IntervalChange | None:
    """The interval after a window of measurements (`cost_s` one snapshot's typical cost, `step_s` a
    typical step), or None to keep `interval`. It grows only once snapshots cost more than MARGIN
    times `max_share`, to where they cost at most `max_share`; it shrinks only to an interval where
    they would cost at most `max_share` / MARGIN. A cost that wanders around its mean by less than
    that factor of 2.25 moves the interval at most once."""
    if every <= 0 or max_share <= 0 or cost_s < 0 or step_s <= 0:
        return None
    share = cost_s / (interval * step_s)
    if share > MARGIN * max_share:
        wanted = snapshot_interval(cost_s, step_s, every=every, max_share=max_share)
        return IntervalChange(wanted, share) if wanted > interval else None
    if interval > every:
        # The shortest interval (a multiple of nothing in particular, at least `every`) cheap enough.
        shorter = max(every, math.ceil(cost_s * MARGIN / (max_share * step_s)))
        if shorter < interval:
            return IntervalChange(shorter, share)
    return None


def slices_held(has_buddy: bool) -> int:
    """The buffers of its slice a worker holds: its own, and the replicas where it backs up a buddy."""
    return SLICES_HELD if has_buddy else OWN_SLICES


def snapshots_unaffordable(slice_bytes: int, budget_bytes: float, *, has_buddy: bool = True) -> str | None:
    """Why a worker must not keep in-memory snapshots of a slice this large, or None when it may.

    A worker holds `slices_held` buffers of a slice (see above); together they must fit in the host
    memory checkpointing may use on its node (`checkpoint.max_host_memory_mb`, or its automatic share)."""
    held = slices_held(has_buddy)
    need = held * slice_bytes
    if need <= budget_bytes:
        return None
    return (
        f"in-memory snapshots need {need / 2**20:.0f} MiB per rank ({held} copies of a "
        f"{slice_bytes / 2**20:.0f} MiB slice), over the {budget_bytes / 2**20:.0f} MiB checkpointing may "
        "use (checkpoint.max_host_memory_mb; unset: half the available memory split between the node's ranks)"
    )
