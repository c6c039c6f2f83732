"""A checkpoint saved on the GPU (the GPU check's cross_device part) resumes on CPU at world size 2, and
the whole route (CPU checkpoint -> device -> CPU) runs here without a GPU.

The route test runs the dry profile in bf16 (the GPU's precision, on DeepSpeed's CPU accelerator): the
CPU's fp32 checkpoint is resumed in bf16 at world size 1 and the bf16 run's checkpoint in fp32 at world
size 2, so both directions of a `training.precision` change on resume are exercised. `python -m
benchmarks.gpu_check --dry --parts cross_device` runs it in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import tarfile

import pytest

from benchmarks.gpu_check import cross_device
from benchmarks.gpu_check.part import PartContext
from benchmarks.gpu_check.profile import DRY, ROOT

pytestmark = pytest.mark.integration

COMMITTED = ROOT / "benchmarks" / "results" / cross_device.ARCHIVE


@pytest.mark.timeout(240)
def test_checkpoint_saved_on_the_gpu_loads_on_cpu_at_world_size_2(ray_local, tmp_path):
    if not COMMITTED.is_file():
        pytest.skip("no checkpoint from a GPU run is committed yet: benchmarks/results/gpu-checkpoint.tar.gz")
    found = cross_device.load_on_cpu(COMMITTED, tmp_path / "load")
    assert found["record"]["device"] != "cpu", found["record"]
    assert found["difference"] <= found["tolerance"], found


@pytest.mark.timeout(300)
def test_a_cpu_checkpoint_moves_to_the_device_and_back_to_cpu(ray_local, tmp_path):
    profile = dataclasses.replace(DRY, precision="bf16")
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    ctx = PartContext(profile, work, out, tmp_path / "result.json")
    cross_device.run(ctx)

    assert ctx.figures["prepared"]["made_here"] is True
    assert json.loads((work / "cpu-checkpoint" / "expected.json").read_text())["world_size"] == 2
    checkpoints = sorted(p.name for p in (work / "cpu-checkpoint" / "run" / "checkpoints").iterdir())
    assert checkpoints == ["latest", f"step-{cross_device.K:06d}"]  # the folder holds step K only
    loaded = ctx.figures["device_load"]
    assert "config changed on resume: training.precision: fp32 -> bf16" in loaded["changes"]
    # bf16 really ran (its loss is not fp32's), within the tolerance, which is far below a step's move.
    assert 0 < loaded["difference"] <= loaded["tolerance"] < loaded["one_step_move"] / 4, loaded
    assert all(t["met"] for t in ctx.targets), ctx.targets

    archive = out / cross_device.ARCHIVE
    assert archive.stat().st_size < cross_device.ARCHIVE_LIMIT_BYTES
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    step = cross_device.K + 2
    assert cross_device.RECORD in names and f"run/checkpoints/step-{step:06d}/manifest.json" in names
    assert not [n for n in names if "/step-" in n and f"step-{step:06d}" not in n]  # that checkpoint only

    back = cross_device.load_on_cpu(archive, tmp_path / "load")
    assert back["record"]["precision"] == "bf16" and back["step"] == step + 1
    assert "config changed on resume: training.precision: bf16 -> fp32" in back["changes"]
    assert "config changed on resume: scaling.max_workers: 1 -> 2" in back["changes"]
    assert 0 < back["difference"] <= back["tolerance"], back
