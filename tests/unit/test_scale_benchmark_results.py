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
