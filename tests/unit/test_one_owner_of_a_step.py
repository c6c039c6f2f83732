"""A step has one owner: the pipeline's fields are written only by the pipeline, recovery timing is one
value consumed by the first step after it, and the workers of an attempt are chosen by a pure rule."""

from __future__ import annotations

import ast
from pathlib import Path

from elastictrain.core.recovery import Recovery
from elastictrain.core.replicas import attempt_workers

SRC = Path(__file__).resolve().parents[2] / "src" / "elastictrain"


def test_nothing_outside_the_pipeline_assigns_to_its_fields() -> None:
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "pipeline.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                continue
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Attribute)
                    and t.value.attr == "pipeline"
                ):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} pipeline.{t.attr}")
    assert not found, found


def test_a_recovery_counts_the_steps_every_set_up_redoes_and_times_from_the_last_detection() -> None:
    r = Recovery(detected_at=100.0).set_up(3, "memory")  # 3 steps redone, then that set-up failed
    r = r.detected(110.0).set_up(1, "disk")
    figures = r.figures(now=115.0, compute_s=2.0)
    assert figures == {
        "recovery_seconds": 5.0,
        "steps_lost": 4.0,
        "recovered_from_memory": 0.0,
        "stall_seconds": 3.0,
    }
    assert "4 step(s) lost; state from disk" in r.describe(figures)


def test_a_grows_stall_counts_from_the_last_step_before_it() -> None:
    r = Recovery(detected_at=50.0, stalled_since=40.0).set_up(0, "memory")
    figures = r.figures(now=60.0, compute_s=1.0)
    assert figures["recovery_seconds"] == 10.0 and figures["stall_seconds"] == 19.0


def test_survivors_keep_their_ranks_and_new_workers_follow() -> None:
    assert attempt_workers(["b", "a"], ["a", "c", "b"], 3, 1, lambda w: "n") == ["b", "a", "c"]
    assert attempt_workers(["b", "a"], ["a", "c", "b"], 2, 1, lambda w: "n") == ["b", "a"]
    assert attempt_workers(["x"], ["a"], 2, 1, lambda w: "n") == ["a"]  # too few: the caller refuses


def test_each_tensor_parallel_replica_is_placed_on_one_node() -> None:
    node = {"a": "n1", "b": "n2", "c": "n1", "d": "n2"}
    chosen = attempt_workers([], ["a", "b", "c", "d"], 4, 2, node.__getitem__)
    assert [node[w] for w in chosen[:2]] in (["n1", "n1"], ["n2", "n2"])
    assert len({node[w] for w in chosen[2:]}) == 1
    assert attempt_workers([], ["a", "b"], 2, 2, node.__getitem__) == []  # no node holds a replica
