"""Every elastictrain process finds the environment's own tools (ninja) first on PATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from elastictrain.worker.ops import prefer_environment_tools


def test_the_interpreters_bin_folder_goes_first_once(monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", bin_dir, "/bin"]))
    prefer_environment_tools()
    prefer_environment_tools()
    assert os.environ["PATH"].split(os.pathsep) == [bin_dir, "/usr/bin", "/bin"]
