"""The core, the control loop and its fake worker group import without ray, deepspeed, torch, mlflow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

PROBE = """
import sys
for name in ("ray", "deepspeed", "mlflow", "torch", "transformers"):
    sys.modules[name] = None  # importing any of them now raises ImportError
import importlib, pkgutil, elastictrain.core as core, elastictrain.control as control
for package in (core, control):
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(m.name)
importlib.import_module("elastictrain.cluster.calls")
importlib.import_module("elastictrain.testing.fake_group")
print("core is pure")
"""


def test_core_imports_with_heavy_dependencies_unimportable():
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "core is pure" in result.stdout


def test_the_probe_would_notice_a_heavy_import():
    # Guards the guard: the same probe fails when a module does import torch.
    probe = PROBE.replace("import importlib", "import torch\nimport importlib")
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC)},
        timeout=60,
    )
    assert result.returncode != 0
