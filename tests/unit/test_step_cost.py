"""What a step costs around its engine (core/step_cost.py)."""

from __future__ import annotations

import pytest

from elastictrain.core.step_cost import StepCosts


def test_the_rest_is_the_median_of_each_steps_own_difference_not_of_the_medians():
    costs = StepCosts()
    for wall, engine in [(0.30, 0.29), (0.50, 0.20), (0.31, 0.30), (0.0, 0.1)]:
        costs.add(wall, engine)
    f = costs.figures()
    assert f["steps"] == 3  # the step with no step before it to measure from is left out
    assert f["median_step_s"] == pytest.approx(0.31)
    assert f["median_engine_s"] == pytest.approx(0.29)
    assert f["median_rest_s"] == pytest.approx(0.01)
    line = costs.describe()
    assert line.startswith("step time (median of 3): 0.310s, of which 0.290s in the engine")
    assert "10.0 ms around it" in line


def test_an_engine_time_beyond_the_wall_time_counts_as_no_rest():
    costs = StepCosts()
    costs.add(0.2, 0.25)  # the slowest rank's clock and the driver's are not the same clock
    assert costs.figures()["median_rest_s"] == 0.0


def test_no_steps_say_nothing():
    assert StepCosts().describe() == "" and StepCosts().figures() == {}


def test_a_finished_run_ends_with_its_step_costs_line_and_logs_both_times_per_step(tmp_path):
    from loop_harness import make_run

    r = make_run(tmp_path)
    assert r.run().status.value == "FINISHED"
    (line,) = r.events("step_costs")
    assert line["message"].startswith("step time (median of ") and line["steps"] >= 1
    assert line["median_rest_s"] == pytest.approx(line["median_step_s"] - line["median_engine_s"], abs=0.2)
    assert {"engine_s", "step_overhead_s"} <= set(r.run_dir.read_info().last_metrics)
    assert "ms around it" in r.terminal.getvalue()
