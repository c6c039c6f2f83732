"""The global batch split and the global data order: exact at every world size."""

from __future__ import annotations

import pytest

from elastictrain.core.batch import BatchPlan, plan_batch, workable_world_sizes
from elastictrain.core.data_order import derive_seed, micro_batch_positions, micro_batch_samples, sample_at


@pytest.mark.parametrize(
    ("gbs", "cap", "world", "expected"),
    [
        (24, 4, 2, (4, 3)),
        (24, 4, 3, (4, 2)),
        (24, 4, 1, (4, 6)),
        (24, 5, 2, (4, 3)),
        (12, 4, 3, (4, 1)),
        (12, 8, 2, (6, 1)),
        (7, 4, 7, (1, 1)),
    ],
)
def test_plan_batch_picks_largest_micro_batch_that_splits_exactly(gbs, cap, world, expected):
    plan = plan_batch(gbs, cap, world)
    assert plan is not None
    assert (plan.micro_batch_size, plan.grad_accum_steps) == expected
    assert plan.global_batch_size == gbs


@pytest.mark.parametrize(("gbs", "world"), [(24, 5), (24, 7), (16, 3), (10, 4)])
def test_plan_batch_refuses_world_sizes_that_do_not_divide_the_global_batch(gbs, world):
    assert plan_batch(gbs, 4, world) is None


def test_workable_world_sizes_lists_only_exact_splits():
    assert workable_world_sizes(24, 4, 1, 8) == [1, 2, 3, 4, 6, 8]
    assert workable_world_sizes(16, 4, 2, 3) == [2]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_every_position_of_a_step_is_read_exactly_once_at_any_world_size(world):
    plan = plan_batch(24, 4, world)
    assert plan is not None
    for step in (0, 1, 7):
        seen = [
            p
            for r in range(world)
            for k in range(plan.grad_accum_steps)
            for p in micro_batch_positions(step, plan, r, k)
        ]
        assert sorted(seen) == list(range(step * 24, (step + 1) * 24))


def test_samples_of_a_step_are_the_same_set_whatever_the_world_size():
    def step_samples(world: int, step: int) -> list[int]:
        plan = plan_batch(24, 4, world)
        assert plan is not None
        return sorted(
            s
            for r in range(world)
            for k in range(plan.grad_accum_steps)
            for s in micro_batch_samples(step, plan, r, k, num_samples=100, seed=3)
        )

    for step in range(10):  # crosses epoch boundaries (100 samples, 24 per step)
        assert step_samples(2, step) == step_samples(3, step) == step_samples(1, step)


def test_each_epoch_is_a_permutation_and_epochs_differ():
    n = 50
    epoch0 = [sample_at(p, n, seed=1) for p in range(n)]
    epoch1 = [sample_at(p, n, seed=1) for p in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1
    assert epoch0 != [sample_at(p, n, seed=2) for p in range(n)]


def test_micro_batch_positions_rejects_out_of_range_rank_and_micro_step():
    plan = BatchPlan(2, 4, 3)
    with pytest.raises(ValueError, match="rank 2"):
        micro_batch_positions(0, plan, 2, 0)
    with pytest.raises(ValueError, match="micro_step 3"):
        micro_batch_positions(0, plan, 0, 3)


def test_derived_seeds_are_deterministic_and_distinct():
    assert derive_seed(42, 10) == derive_seed(42, 10)
    assert len({derive_seed(42, p) for p in range(1000)}) == 1000
    assert 0 <= derive_seed(1, 2, 3) < 2**63
