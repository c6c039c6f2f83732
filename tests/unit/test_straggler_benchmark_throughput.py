"""The straggler benchmark's throughput over a span of steps, where the controller skipped reporting one."""

from __future__ import annotations

import pytest

from benchmarks.straggler import _throughput


def _steps(times: dict[int, float]) -> list[dict[str, float]]:
    return [{"step": step, "time": t} for step, t in times.items()]


def test_throughput_counts_samples_over_the_span_from_the_step_before_the_first() -> None:
    steps = _steps({1: 0.0, 2: 1.0, 3: 2.0, 4: 4.0})
    assert _throughput(steps, 3, 4, batch=6) == pytest.approx(2 * 6 / 3.0)


def test_a_step_never_reported_before_the_span_starts_it_at_the_nearest_earlier_step() -> None:
    # Step 8 was in flight when the straggler was dropped: the span runs from step 7, counting 9 steps.
    times = {step: float(step) for step in range(1, 17) if step != 8}
    assert _throughput(_steps(times), 9, 16, batch=4) == pytest.approx(9 * 4 / 9.0)


def test_no_throughput_without_the_last_step_or_any_step_before_the_span() -> None:
    assert _throughput(_steps({1: 0.0, 2: 1.0}), 2, 3, batch=4) is None
    assert _throughput(_steps({2: 1.0, 3: 2.0}), 2, 3, batch=4) is None
