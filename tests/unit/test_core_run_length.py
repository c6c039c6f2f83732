"""training.num_epochs and warmup_ratio as step counts (core/run_length.py), and what the steps read."""

from __future__ import annotations

from collections import Counter

import pytest

from elastictrain.core.batch import plan_batch
from elastictrain.core.data_order import epoch_permutation, micro_batch_samples
from elastictrain.core.run_length import epoch_length, steps_for_epochs, warmup_for_ratio


@pytest.mark.parametrize(
    ("epochs", "samples", "batch", "steps"),
    [
        (3, 80, 8, 30),  # exact: no batch straddles the end
        (3, 10, 4, 8),  # 30 positions: rounded up to 32
        (1, 5, 8, 1),  # fewer samples than a batch: one step
        (1.1, 100, 10, 11),  # 110 positions exactly, not 110.00000000000001
        (0.5, 9, 2, 3),  # 4.5 samples: 5 are read, so 3 steps
        (2, 1, 1, 2),
    ],
)
def test_steps_round_up_to_whole_global_batches(epochs, samples, batch, steps):
    assert steps_for_epochs(epochs, samples, batch) == steps


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 10, 2), "training.num_epochs"), ((1, 0, 2), "training.num_epochs"), ((1, 10, 0), "global_batch")],
)
def test_impossible_lengths_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        steps_for_epochs(*args)


@pytest.mark.parametrize(
    ("ratio", "steps", "warmup"), [(0.1, 30, 3), (0.1, 31, 4), (0.0, 30, 0), (1.0, 7, 7), (0.03, 100, 3)]
)
def test_warmup_ratio_rounds_up_as_transformers_does(ratio, steps, warmup):
    assert warmup_for_ratio(ratio, steps) == warmup


def test_warmup_ratio_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="training.warmup_ratio"):
        warmup_for_ratio(1.5, 10)


def test_the_description_says_how_many_samples_the_last_step_repeats():
    exact = epoch_length(3, 80, 8)
    assert (exact.steps, exact.repeated) == (30, 0)
    assert "= 30 steps" in exact.describe() and "next epoch" not in exact.describe()
    filled = epoch_length(3, 10, 4)
    assert (filled.steps, filled.repeated) == (8, 2)
    assert "with 2 sample(s) from the start of the next epoch's order" in filled.describe()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_three_epochs_read_every_sample_three_times_and_the_fill_once_more(world):
    """What the sample ledger of such a run holds, at any world size: each sample 3 times, and the
    last step's fill (the first samples of epoch 4's order) a 4th time."""
    n, batch, seed = 10, 4, 7
    length = epoch_length(3, n, batch)
    plan = plan_batch(batch, 2, world)
    assert plan is not None
    read = Counter(
        i
        for step in range(length.steps)
        for rank in range(world)
        for micro in range(plan.grad_accum_steps)
        for i in micro_batch_samples(step, plan, rank, micro, n, seed)
    )
    fill = set(epoch_permutation(n, seed, 3)[: length.repeated])
    assert sum(read.values()) == length.steps * batch == 32
    assert {i: c for i, c in read.items() if c == 4}.keys() == fill
    assert all(read[i] == 3 for i in range(n) if i not in fill)
