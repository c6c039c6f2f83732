"""The scale benchmark resumes from, and saves to, the folder it is given (run.py's --results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is run from the repo root
from benchmarks import scale  # noqa: E402
from benchmarks.common import RESULTS  # noqa: E402


def test_sizes_measured_before_are_read_from_and_saved_to_the_given_folder(tmp_path: Path) -> None:
    measured = json.loads((RESULTS / "scale.json").read_text())["runs"]  # the last real run's rows
    assert scale.previous_sizes(tmp_path) == {}
    scale.save_partial({r["size"]: r for r in measured}, tmp_path)
    again = scale.previous_sizes(tmp_path)
    assert sorted(again) == sorted(r["size"] for r in measured)
    assert again[measured[0]["size"]]["parameters"] == measured[0]["parameters"]


def test_a_size_whose_reshard_load_failed_is_summarized_with_the_failure_as_its_finding() -> None:
    row = json.loads((RESULTS / "scale.json").read_text())["runs"][0]
    failed = {"outcome": "failed", "error": "torchrun loading a checkpoint at world size 3: exit code 1"}
    row = {**row, "reshard": {**failed, "bytes": row["reshard"]["bytes"]}}
    result = scale.summarize({row["size"]: row}, smoke=False)
    metrics = result.metrics[row["size"]]
    assert metrics["reshard_2_to_3_s"] is None and metrics["reshard_2_to_3_vs_disk_read"] is None
    (target,) = [t for t in result.targets if t.name.endswith("reshard 2->3 load / disk read bandwidth")]
    assert target.value is None and "the load failed: torchrun loading" in target.note
    assert metrics["throughput_vs_deepspeed"] is not None  # the size's other parts stand
