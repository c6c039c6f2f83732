"""The GPU kit (benchmarks/gpu_check/kit.py): built from PyPI here, it installs offline into a clean
Python 3.12 target exactly as on the GPU machine, its Ray starts a cluster there, and with the working
tree it fits what the GPU machine receives. Needs PyPI the first time (then the download cache)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `benchmarks` is run from the repo root
from benchmarks.gpu_check.kit import DEFAULT_KIT, kit_is_current  # noqa: E402
from benchmarks.gpu_check.verify import find_python312  # noqa: E402
from benchmarks.gpu_check.wheels import sha256_file  # noqa: E402

pytestmark = pytest.mark.integration


def kit_command(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.kit", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def build(kit: Path) -> str:
    done = kit_command("build", "--kit", str(kit), timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """.gpu-kit where it is built from the current recipe and unaltered, else a fresh build."""
    if kit_is_current(DEFAULT_KIT):
        return DEFAULT_KIT
    fresh = tmp_path_factory.mktemp("gpu-kit")
    build(fresh)
    return fresh


@pytest.mark.timeout(2400)
def test_gpu_kit_installs_offline_into_a_clean_python312_target(kit: Path):
    python = find_python312()
    if python is None:
        pytest.skip("no Python 3.12 here (python3.12 on PATH or ~/.pyenv/versions/3.12*): the GPU machine's")
    done = kit_command("verify", "--kit", str(kit), "--python", python, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "ray cluster ran 3 actors" in done.stdout
    assert "verify passed" in done.stdout


@pytest.mark.timeout(1500)
def test_gpu_kit_and_working_tree_fit_what_the_gpu_machine_receives(kit: Path):
    done = kit_command("size", "--kit", str(kit), "--limit-mib", "60", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "working tree" in done.stdout
    over = kit_command("size", "--kit", str(kit), "--limit-mib", "1", timeout=120)
    assert over.returncode == 1 and "above the 1 MiB limit" in over.stderr


@pytest.mark.timeout(1500)
def test_gpu_kit_manifest_says_why_each_wheel_comes_and_what_stays_behind(kit: Path):
    manifest = json.loads((kit / "manifest.json").read_text())
    wheels = {w["name"]: w for w in manifest["wheels"]}
    assert {"ray", "deepspeed", "omegaconf", "pydantic", "hjson"} <= set(wheels)
    for w in wheels.values():
        assert sha256_file(kit / "wheels" / w["file"]) == w["sha256"]
        assert w["why"].startswith("elastictrain ") and w["why"].endswith(w["name"])
    assert {n["name"] for n in manifest["not_brought"]} >= {"mlflow", "ray extras"}
    assert wheels["deepspeed"]["file"] == "deepspeed-0.19.8-py3-none-any.whl"
    assert manifest["deepspeed_build"]["ok"] is True
    with zipfile.ZipFile(kit / "wheels" / wheels["ray"]["file"]) as z:
        names = z.namelist()
    assert not any(n.startswith("ray/jars/") for n in names) and "ray/_raylet.so" in names
    assert "torch" in {p["name"] for p in manifest["on_gpu_machine"]}


@pytest.mark.timeout(2400)
def test_a_second_gpu_kit_build_takes_every_wheel_from_the_download_cache(tmp_path: Path):
    first = tmp_path / "first"
    build(first)
    second = tmp_path / "second"
    out = build(second)
    assert "download " not in out and "build deepspeed" not in out and "repack " not in out, out
    sums = [{w["file"]: w["sha256"] for w in json.loads((k / "manifest.json").read_text())["wheels"]}
            for k in (first, second)]  # fmt: skip
    assert sums[0] == sums[1]
