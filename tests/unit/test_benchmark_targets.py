"""A benchmark target is met or missed by its direction, strict or not; a negative figure is invalid."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is run from the repo root
from benchmarks import report  # noqa: E402
from benchmarks.common import Target  # noqa: E402
from benchmarks.validity import GENERIC_CAUSE  # noqa: E402


@pytest.mark.parametrize(
    ("value", "direction", "met"),
    [(1.37, ">", True), (1.0, ">", False), (1.0, ">=", True), (0.9, ">=", False),
     (0.5, "<", True), (1.0, "<", False), (1.0, "<=", True), (1.1, "<=", False)],
)  # fmt: skip
def test_a_target_is_met_by_its_direction(value: float, direction: str, met: bool):
    result = Target("figure", value, 1.0, direction).as_dict()
    assert result["met"] is met
    assert (result["missed_by"] is None) is met


@pytest.mark.parametrize("direction", [">=", ">", "<=", "<"])
def test_a_negative_duration_or_cost_is_an_invalid_measurement_never_met(direction: str):
    result = Target(
        "30m: recovery, fixed part (redone step's compute excluded)", -4.05, 3.0, direction
    ).as_dict()
    assert result["met"] is None and result["missed_by"] is None
    assert result["invalid"].startswith(
        "negative (-4.05): the figure is kill-to-first-step less two allowances"
    )


def test_a_negative_figure_without_a_known_cause_says_why_it_cannot_be_negative():
    result = Target("some new cost", -0.1, 0.03, "<=", unit="fraction").as_dict()
    assert result["invalid"] == f"negative (-0.1): {GENERIC_CAUSE}"
    assert Target("some new cost", 0.0, 0.03, "<=").as_dict()["invalid"] is None  # zero is a figure


def _stored(name: str, value: float, met: bool) -> dict:
    """A result as an older run stored it: its `met` judged before the negative rule existed."""
    target = {"name": name, "value": value, "target": 0.03, "direction": "<=", "unit": "fraction"}
    return {
        "benchmark": "memory_recovery",
        "smoke": False,
        "repetitions": 1,
        "machine": {"cpus": 2, "platform": "Linux", "python": "3.11"},
        "versions": {"elastictrain": "0.1.0"},
        "workload": {},
        "metrics": {"step_cost": value},
        "targets": [{**target, "met": met, "missed_by": None, "note": ""}],
        "notes": [],
    }


def test_the_report_judges_stored_figures_again_and_says_up_front_where_they_were_measured(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    name = "memory recovery: per-step cost of snapshots and replication (wall)"
    report.write_markdown([_stored(name, -0.0724, met=True)], out, plots={})
    text = out.read_text()
    assert (
        "measured on CPU, with the gloo backend, on 2 cores" in text.split("\n## ")[0].split("Generated")[0]
    )
    row = next(line for line in text.splitlines() if line.startswith(f"| memory_recovery | {name} |"))
    assert "**invalid measurement**" in row and "| met |" not in row
    assert f"- {name}: negative (-0.0724): steps with snapshots ran faster than steps without them" in text
