"""A benchmark target is met or missed by its direction, strict or not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is run from the repo root
from benchmarks.common import Target  # noqa: E402


@pytest.mark.parametrize(
    ("value", "direction", "met"),
    [(1.37, ">", True), (1.0, ">", False), (1.0, ">=", True), (0.9, ">=", False),
     (0.5, "<", True), (1.0, "<", False), (1.0, "<=", True), (1.1, "<=", False)],
)  # fmt: skip
def test_a_target_is_met_by_its_direction(value: float, direction: str, met: bool):
    result = Target("figure", value, 1.0, direction).as_dict()
    assert result["met"] is met
    assert (result["missed_by"] is None) is met
