"""The GPU check's runner: a part stopped at its time limit still leaves what it recorded, a failing part
says why, and the BENCHMARKS.md section reads either (no GPU, no DeepSpeed: a part here is a tiny module)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.gpu_check import report
from benchmarks.gpu_check.__main__ import run_part

SLOW_PART = """
import time

def run(ctx):
    ctx.record("first", 1.5)
    ctx.target("a figure", 2.0, 3.0, "<=")
    time.sleep(60)
    ctx.record("never", True)
"""

FAILING_PART = """
def run(ctx):
    ctx.record("before", "x")
    raise RuntimeError("the device said no")
"""


def _package(tmp_path: Path, package: str, module: str, text: str) -> dict[str, str]:
    """A module `package.module` on a PYTHONPATH of its own; returns the environment naming it."""
    folder = tmp_path / "mods" / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / f"{module}.py").write_text(text)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "mods"), os.environ.get("PYTHONPATH", "")])}


def test_a_part_stopped_at_its_limit_keeps_what_it_recorded(tmp_path: Path) -> None:
    env = _package(tmp_path, "pkg", "slow", SLOW_PART)
    result = run_part("pkg.slow", "dry", 8, tmp_path, tmp_path, env)
    assert result["status"] == "timed out"
    assert result["seconds"] < 30
    assert result["figures"] == {"first": 1.5}
    assert result["targets"][0]["met"] is True


def test_a_failing_part_reports_its_error_and_what_it_measured_before(tmp_path: Path) -> None:
    env = _package(tmp_path, "pkg2", "failing", FAILING_PART)
    result = run_part("pkg2.failing", "dry", 60, tmp_path, tmp_path, env)
    assert result["status"] == "failed"
    assert result["figures"]["before"] == "x"
    assert "the device said no" in result["figures"]["error"]
    assert any("the device said no" in line for line in result["log_tail"])


def test_benchmarks_section_says_when_no_gpu_result_exists(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## throughput\n\nrows\n")
    report.update_markdown(md, None)
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\n## throughput\n\nrows\n\n## GPU check")
    assert "Not run on a GPU yet" in text
    report.update_markdown(md, None)  # rewriting replaces the section, never appends a second one
    assert md.read_text().count("## GPU check") == 1


def test_benchmarks_section_shows_a_gpu_result_with_its_missed_targets() -> None:
    result = {
        "profile": "gpu",
        "started": "2026-11-27T00:00:00+00:00",
        "parts": {
            "environment": {
                "status": "ok",
                "seconds": 9.0,
                "figures": {
                    "cuda": {
                        "devices": [{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85e9}],
                        "nccl": "2.27",
                    },
                    "versions": {"torch": "2.11.0"},
                },
                "targets": [],
            },
            "throughput": {
                "status": "timed out",
                "seconds": 160.0,
                "figures": {"deepspeed": {"tokens_per_s": 51000.0}},
                "targets": [{"name": "ratio", "value": 0.9, "target": 0.97, "direction": ">=", "met": False}],
                "log_tail": ["step 3"],
            },
        },
    }
    text = "\n".join(report.section(json.loads(json.dumps(result))))
    assert "NVIDIA H100 80GB HBM3" in text
    assert "| throughput | ratio | >= 0.97 | 0.9 | **missed** |" in text
    assert "| throughput | deepspeed.tokens_per_s | 5.1e+04 |" in text
    assert "- throughput: timed out; last line: `step 3`" in text


CUDA_ADAM = "state_steps is on cpu"


def test_a_merged_result_says_which_run_measured_each_part_and_a_failure_shows_its_error() -> None:
    result = {
        "profile": "gpu",
        "started": "2026-11-28T00:00:00+00:00",
        "merged_from": {"run1": "every part", "run2": "cross_device again"},
        "parts": {
            "cross_device": {
                "status": "failed",
                "seconds": 41.0,
                "from_run": "run2",
                "figures": {
                    "error": "Traceback (most recent call last):\nRuntimeError: state_steps is on cpu"
                },
                "targets": [],
                "log_tail": ["[gpu] part cross_device took 38.0s"],
            },
        },
    }
    text = "\n".join(report.section(result))
    assert "cross_device failed (41s, run2)" in text
    assert "- run2: cross_device again" in text
    assert f"- cross_device: failed; last line: `RuntimeError: {CUDA_ADAM}`" in text


def test_a_checkpoints_cost_is_its_pause_plus_the_step_after_beyond_the_median() -> None:
    from benchmarks.gpu_check.throughput import checkpoint_cost

    # The first GPU run: a 0.02 s pause, then a 35 s step where the median step took 1.13 s.
    assert checkpoint_cost(0.02, 35.0, 1.13) == pytest.approx(33.89)
    assert checkpoint_cost(0.02, 1.0, 1.13) == 0.02  # a step after no slower than the median adds nothing
    assert checkpoint_cost(None, 35.0, 1.13) is None
