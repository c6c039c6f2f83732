"""Which worker backs up which rank, and which in-memory snapshot a restart may load (core)."""

from __future__ import annotations

import itertools

from elastictrain.core.snapshot_plan import (
    MAX_INTERVAL,
    SLICES_HELD,
    Held,
    IntervalChange,
    assign_buddies,
    choose_memory_snapshot,
    next_interval,
    off_node,
    snapshot_interval,
    snapshots_unaffordable,
)


def test_every_buddy_is_on_another_node_while_no_node_holds_more_than_half_the_ranks():
    for nodes in (
        ["a", "b"],
        ["a", "b", "c"],
        ["a", "a", "b", "b"],
        ["a", "b", "a", "b", "c", "c"],
        ["n1", "n1", "n1", "n2", "n2", "n3"],
        ["x", "y", "x", "z", "y", "x"],
    ):
        buddies = assign_buddies(nodes)
        assert off_node(nodes, buddies), (nodes, buddies)
        assert sorted(b for b in buddies if b is not None) == list(range(len(nodes)))  # one replica each
        assert all(b != r for r, b in enumerate(buddies))


def test_on_one_node_the_buddy_is_the_next_worker_and_alone_there_is_none():
    assert assign_buddies(["a", "a", "a"]) == [1, 2, 0]
    assert not off_node(["a", "a", "a"], assign_buddies(["a", "a", "a"]))
    assert assign_buddies(["a"]) == [None]


def test_a_node_with_most_ranks_still_gets_a_buddy_elsewhere_for_the_others():
    nodes = ["a", "a", "a", "b"]
    buddies = assign_buddies(nodes)
    assert all(b is not None and b != r for r, b in enumerate(buddies))
    assert not off_node(nodes, buddies)  # impossible for all: said, not hidden


def held(world: int, step: int, ranks=None, attempt: int = 1, worker=lambda r: f"w{r}", own=True):  # noqa: ANN001, ANN201
    return [Held(worker(r), attempt, world, r, step, own) for r in (range(world) if ranks is None else ranks)]


def test_the_newest_step_every_rank_has_is_chosen_and_own_copies_are_preferred():
    survivors = (
        held(3, 7, ranks=[0, 1]) + held(3, 6) + held(3, 7, ranks=[2], worker=lambda r: "w0", own=False)
    )
    choice = choose_memory_snapshot(survivors, max_step=7, disk_step=4)
    assert choice.plan is not None
    assert choice.plan.step == 7 and choice.plan.world_size == 3
    assert choice.plan.holders == {0: "w0", 1: "w1", 2: "w0"}  # rank 2's slice from its buddy


def test_a_snapshot_past_the_reported_step_is_not_used():
    choice = choose_memory_snapshot(held(2, 8) + held(2, 7), max_step=7, disk_step=0)
    assert choice.plan is not None and choice.plan.step == 7


def test_a_copy_in_progress_on_one_rank_falls_back_to_the_previous_complete_step():
    # Rank 1 had not finished (or replicated) its step-7 copy when it died: step 6 is what all hold.
    survivors = held(2, 7, ranks=[0]) + held(2, 6, ranks=[0]) + held(2, 6, ranks=[1], worker=lambda r: "w0")
    choice = choose_memory_snapshot(survivors, max_step=7, disk_step=4)
    assert choice.plan is not None and choice.plan.step == 6


def test_a_rank_lost_with_its_buddy_falls_back_to_disk_and_says_which():
    choice = choose_memory_snapshot(held(3, 7, ranks=[0, 1]), max_step=7, disk_step=4)
    assert choice.plan is None
    assert "rank(s) [2]" in choice.reason and "buddy" in choice.reason


def test_ranks_at_different_steps_are_inconsistent():
    choice = choose_memory_snapshot(held(2, 7, ranks=[0]) + held(2, 5, ranks=[1]), max_step=7, disk_step=0)
    assert choice.plan is None and "inconsistent" in choice.reason


def test_a_newer_disk_checkpoint_wins_and_an_equal_one_does_not():
    assert choose_memory_snapshot(held(2, 6), max_step=9, disk_step=8).plan is None
    equal = choose_memory_snapshot(held(2, 8), max_step=9, disk_step=8)
    assert equal.plan is not None and equal.plan.step == 8  # same state, no disk read


def test_nothing_held_says_so():
    choice = choose_memory_snapshot([], max_step=3, disk_step=0)
    assert choice.plan is None and "no survivor" in choice.reason


def test_snapshots_of_an_earlier_attempt_serve_when_the_new_one_has_none_complete():
    # The new attempt (2, world 2) failed before all its ranks held a snapshot; attempt 1's are whole.
    old = held(3, 5, attempt=1)
    new = held(2, 6, ranks=[0], attempt=2)
    choice = choose_memory_snapshot(old + new, max_step=6, disk_step=4)
    assert choice.plan is not None and (choice.plan.attempt, choice.plan.step) == (1, 5)


def test_buddy_assignment_is_a_permutation_for_every_small_layout():
    for n in range(2, 7):
        for nodes in itertools.product("ab", repeat=n):
            buddies = assign_buddies(list(nodes))
            assert sorted(buddies) == list(range(n))  # type: ignore[type-var]
            if max(nodes.count("a"), nodes.count("b")) * 2 <= n:
                assert off_node(list(nodes), buddies), nodes


def test_snapshots_are_spaced_out_until_they_cost_at_most_the_allowed_share():
    # A snapshot costing 0.3 s against 3 s steps is 10% of every step: 4 steps apart it is 2.5%.
    assert snapshot_interval(0.3, 3.0, every=1, max_share=0.03) == 4
    assert snapshot_interval(0.01, 3.0, every=1, max_share=0.03) == 1  # cheap: every step
    assert snapshot_interval(0.01, 3.0, every=5, max_share=0.03) == 5  # never more often than asked
    assert snapshot_interval(0.3, 3.0, every=1, max_share=0.0) == 1  # the rule off: as asked
    assert snapshot_interval(0.3, 3.0, every=0, max_share=0.03) == 0  # snapshots off stay off
    assert snapshot_interval(0.0, 3.0, every=2, max_share=0.03) == 2  # nothing measured yet
    assert snapshot_interval(1e6, 1e-3, every=1, max_share=0.03) == MAX_INTERVAL


def test_snapshots_that_would_not_fit_the_memory_budget_are_refused_with_the_numbers():
    slice_bytes = 100 * 2**20
    assert snapshots_unaffordable(slice_bytes, SLICES_HELD * slice_bytes) is None
    why = snapshots_unaffordable(slice_bytes, 500 * 2**20)
    assert why is not None
    assert f"{SLICES_HELD * 100} MiB" in why and "100 MiB slice" in why and "500 MiB" in why
    assert "checkpoint.max_host_memory_mb" in why


def test_the_interval_moves_only_past_a_margin_of_the_allowed_share():
    # Every step, a snapshot costing 4% of a step: over 3%, within the margin (4.5%): no move.
    assert next_interval(0.04, 1.0, interval=1, every=1, max_share=0.03) is None
    # 6%: over the margin, to the interval where it costs at most 3%.
    assert next_interval(0.06, 1.0, interval=1, every=1, max_share=0.03) == IntervalChange(2, 0.06)
    # Back at every 2 steps, 2.5% would be within budget at every step but not by the margin: stays.
    assert next_interval(0.025, 1.0, interval=2, every=1, max_share=0.03) is None
    # 1.8%: 1.8 x 1.5 = 2.7% at every step: down to every step.
    assert next_interval(0.018, 1.0, interval=2, every=1, max_share=0.03) == IntervalChange(1, 0.009)
    assert next_interval(0.0, 1.0, interval=8, every=2, max_share=0.03) == IntervalChange(2, 0.0)
    assert next_interval(0.5, 1.0, interval=1, every=1, max_share=0.0) is None  # the rule off
    assert next_interval(0.5, 1.0, interval=0, every=0, max_share=0.03) is None  # snapshots off
