"""`make gpu-check GPU_CHECK_DRY=1`: every part of the GPU check runs here on CPU (gloo, the tiny model),
through the same script the GPU machine runs, so the check cannot rot between the rare GPU runs.

It runs with the packages the kit leaves out (MLflow, datasets, s3fs: kit.NOT_BROUGHT) made unimportable
in every process, Ray's workers included, as they are on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.gpu_check.__main__ import run_part
from benchmarks.gpu_check.kit import NOT_BROUGHT
from benchmarks.gpu_check.profile import PARTS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# Imported by every Python process started with this folder on PYTHONPATH: the names are then missing
# as on a machine without them (importlib.util.find_spec says None, `import` raises ImportError).
SITECUSTOMIZE = """
import sys
for name in {names!r}:
    sys.modules[name] = None
"""


def without_packages(tmp_path: Path, names: list[str]) -> str:
    folder = tmp_path / "blocked"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(names=names))
    return os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])


def test_dry_gpu_check_runs_every_part_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "out"
    blocked = sorted(NOT_BROUGHT)
    env = {
        **os.environ,
        "GPU_CHECK_DRY": "1",
        "PYTHON": sys.executable,
        "PYTHONPATH": without_packages(tmp_path, blocked),
    }
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check/gpu-check.sh", "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = json.loads((out / "gpu-check.json").read_text())
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    assert done.returncode == 0, f"{statuses}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert list(statuses) == list(PARTS) and set(statuses.values()) == {"ok"}
    parts = report["parts"]
    assert report["build_ops"]["status"] == "ok"
    # On CPU in fp32 elastictrain must match plain PyTorch through Ray and --local, as the CPU tests say.
    numerics = {t["name"]: t for t in parts["numerics"]["targets"]}
    assert len(numerics) == 2 and all(t["met"] for t in numerics.values()), numerics
    throughput = parts["throughput"]["figures"]
    for system in ("deepspeed", "elastictrain"):
        assert throughput[system]["tokens_per_s"] > 0
    # The ladder: the automatic choice first, then the preset it replaced, each run by both systems.
    ladder = throughput["ladder"]
    assert list(ladder)[:2] == ["auto", "before"]
    assert throughput["setting"]["choice"][0].startswith("layout (auto) at world size 1: ZeRO-0")
    assert ladder["before"]["layout"]["zero_stage"] == 3
    for rung in ("auto", "before"):
        assert (
            ladder[rung]["elastictrain"]["tokens_per_s"] > 0 and ladder[rung]["deepspeed"]["tokens_per_s"] > 0
        )
    assert throughput["checkpoint"]["elastictrain_pause_s"] is not None
    # A checkpoint's cost counts the step after it, which waits for its copy (not the pause alone).
    assert throughput["checkpoint"]["elastictrain_step_after_s"] > 0
    assert (
        throughput["checkpoint"]["elastictrain_training_lost_s"]
        >= throughput["checkpoint"]["elastictrain_pause_s"]
    )
    assert throughput["host_copy"] == {"not_measured": "no GPU"}
    assert "TORCH_CUDA_ARCH_LIST" in parts["environment"]["figures"]["build_env"]
    assert throughput["checkpoint"]["deepspeed_save_checkpoint_s"] > 0
    for where in ("cpu", "nvme"):
        offload = parts["offload"]["figures"][where]
        assert offload["host_peak_bytes"] > 0 and offload["estimate"]["host_bytes"] > 0
    assert all(t["met"] for t in parts["cross_device"]["targets"]), parts["cross_device"]["targets"]
    tp = parts["tensor_parallel"]["figures"]
    assert tp["tp2_vs_zero3_step_time"] > 0
    assert tp["tp2_zero1"]["losses"] == pytest.approx(tp["zero3_dp2"]["losses"], rel=1e-4)  # one model
    pp = parts["pipeline"]["figures"]
    assert pp["pp2_vs_zero3_step_time"] > 0
    assert pp["pp2_zero1"]["losses"] == pytest.approx(pp["zero3_dp2"]["losses"], rel=1e-4)  # one model
    with tarfile.open(out / "gpu-checkpoint.tar.gz") as archive:
        assert any(name.endswith("gpu-checkpoint.json") for name in archive.getnames())
    log = (out / "gpu-check.log").read_text()
    assert parts["environment"]["figures"]["versions"]["mlflow"].startswith("absent")
    assert all(f"===== part {name} =====" in log for name in PARTS)


def test_bf16_runs_match_the_bf16_reference_within_its_derived_tolerance(tmp_path: Path) -> None:
    """The GPU's comparison, made here: DeepSpeed's bf16 ZeRO-3 (CPU accelerator) through Ray and --local
    against the plain PyTorch loop in DeepSpeed's bf16 scheme (bf16 weights, fp32 master)."""
    result = run_part("numerics", "dry-bf16", 400, tmp_path, tmp_path)
    assert result["status"] == "ok", result["log_tail"]
    reference = result["figures"]["reference"]
    assert reference["noise"] > 1e-6  # bf16's summation-order noise, far above fp32's
    targets = result["targets"]
    assert len(targets) == 2 and all(t["met"] for t in targets), targets
