"""Whether a target's figure is a valid measurement, and if so whether it meets its target.

Every figure of the targets table is a duration, a cost, a count, a bandwidth or a ratio of such
quantities: none can be below zero. A negative one comes from a difference of measurements (a step
time with and without snapshots, a restart less the allowances for its load and redone step) whose
noise or model error exceeds the effect measured. It is reported as an invalid measurement with its
cause, never as met, whatever the direction of its target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Why a figure came out negative, by a fragment of the target's name; the first match is used.
NEGATIVE_CAUSES = {
    "recovery, fixed part": "the figure is kill-to-first-step less two allowances, the checkpoint's bytes "
    "at half the disk's read bandwidth and the redone step's compute; the restart took less than those "
    "allowances (the load read faster than half the bandwidth the disk probe measured, e.g. from the page "
    "cache), so the subtraction does not measure the fixed part",
    "per-step cost": "steps with snapshots ran faster than steps without them: the figure compares single "
    "runs whose step times vary by more (up to 20% on shared cores) than the cost being measured",
}
GENERIC_CAUSE = (
    "a duration or cost cannot be below zero: the figure is a difference of measurements whose noise "
    "exceeds the effect measured"
)


@dataclass(frozen=True)
class Verdict:
    met: bool | None  # None: not measured, or measured but invalid
    missed_by: float | None  # how far off, as a fraction of the target (0.25 = 25% short of / over it)
    invalid: str | None  # why the figure is not a valid measurement; None when it is


def negative_cause(name: str) -> str:
    return next((cause for key, cause in NEGATIVE_CAUSES.items() if key in name), GENERIC_CAUSE)


def judge(name: str, value: float | None, target: float, direction: str) -> Verdict:
    """Met, missed (and by how much), not measured, or invalid (a negative figure, with its cause)."""
    if value is None or not math.isfinite(value):
        return Verdict(None, None, None)
    if value < 0:
        return Verdict(None, None, f"negative ({value:.3g}): {negative_cause(name)}")
    met = {
        ">=": value >= target,
        ">": value > target,
        "<=": value <= target,
        "<": value < target,
    }[direction]
    missed_by = None if met or not target else abs(value - target) / abs(target)
    return Verdict(met, missed_by, None)
