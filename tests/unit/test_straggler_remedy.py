"""What the controller does with a named straggler (control/stragglers.py, failure.replace_stragglers):
replace it with a warm spare, drop it where the smaller world is faster, else keep it and say why; a
straggler replaced or dropped has its node avoided for new workers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from loop_harness import make_run

from elastictrain.control.errors import AttemptFailed
from elastictrain.control.stragglers import Stragglers


def _watched(tmp_path: Path, *overrides: str) -> tuple[Stragglers, object, object]:
    r = make_run(
        tmp_path,
        "failure.replace_stragglers=true",
        "failure.straggler_steps=3",
        "scaling.min_workers=2",
        *overrides,
    )
    s = Stragglers(r.controller.cfg, r.controller.recorder, r.group)
    s.attach([SimpleNamespace(worker_id=f"w{i}", node_id=f"node-{i}") for i in range(3)])
    return s, r, r.group


def _steps(s: Stragglers, start: int, n: int, slow_forward: float, wall: float) -> None:
    for i in range(start, start + n):
        results = [{"rank": r, "forward_s": slow_forward if r == 1 else 0.1} for r in range(3)]
        s.note(i, results, wall)


def test_a_straggler_without_a_spare_is_dropped_where_two_ranks_are_faster_and_its_node_avoided(tmp_path):
    s, r, group = _watched(tmp_path)
    _steps(s, 0, 5, 0.1, 1.0)  # even: 1.0 s a step at 3 ranks, so 1.5 s at 2
    _steps(s, 5, 3, 0.4, 2.0)  # rank 1 at 4x: 2.0 s a step
    with pytest.raises(AttemptFailed) as e:
        s.replace_named(spare_ready=lambda: False)
    failure = e.value.failure
    assert failure.kind == "straggler" and failure.worker_ids == ("w1",)
    assert "dropped (2 ranks take about 1.5s a step against 2s now with it)" in failure.message
    assert group.avoided == [("node-1", 1800.0)]


def test_a_warm_spare_replaces_a_straggler_whatever_the_pace(tmp_path):
    s, _, group = _watched(tmp_path, "failure.straggler_avoid_s=0")
    _steps(s, 0, 5, 0.1, 1.0)
    _steps(s, 5, 3, 0.4, 1.1)
    with pytest.raises(AttemptFailed) as e:
        s.replace_named(spare_ready=lambda: True)
    assert "replaced by a warm spare" in e.value.failure.message
    assert group.avoided == []  # straggler_avoid_s=0: no avoiding


def test_a_straggler_costing_less_than_a_rank_is_kept_and_the_reason_recorded(tmp_path):
    s, r, group = _watched(tmp_path)
    _steps(s, 0, 5, 0.1, 1.0)
    _steps(s, 5, 3, 0.4, 1.2)  # 1.2 s with it; 1.5 s without
    s.replace_named(spare_ready=lambda: False)
    (kept,) = r.events("straggler_kept")
    assert kept["rank"] == 1 and "2 ranks would take about 1.5s a step against 1.2s now" in kept["message"]
    assert group.avoided == []
