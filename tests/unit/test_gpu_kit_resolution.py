"""The GPU kit's closure over Requires-Dist, its refusal of a second version, and ray's repack, on
synthetic METADATA and wheels (no network; benchmarks/gpu_check/wheels.py)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is run from the repo root
from benchmarks.gpu_check.kit import GPU_LIST, constraints, pyproject_roots  # noqa: E402
from benchmarks.gpu_check.wheels import (  # noqa: E402
    TARGET_ENV,
    Fetched,
    FetchError,
    read_gpu_list,
    repack_wheel,
    requirements,
    resolve,
)


def metadata(name: str, version: str, *requires: str) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    return "\n".join(lines + [f"Requires-Dist: {r}" for r in requires]) + "\n"


class Index:
    """A fake PyPI: name -> METADATA; records what was fetched."""

    def __init__(self, *packages: str) -> None:
        self.packages = {p.split("\n")[1].removeprefix("Name: ").lower(): p for p in packages}
        self.fetched: list[str] = []

    def __call__(self, req: Requirement) -> Fetched:
        self.fetched.append(req.name)
        if req.name not in self.packages:
            raise FetchError(f"no wheel for {req}")
        return Fetched(Path(f"{req.name}-1.0-py3-none-any.whl"), self.packages[req.name])


def roots(*reqs: str) -> list[tuple[Requirement, str]]:
    return [(Requirement(r), "elastictrain") for r in reqs]


def test_the_closure_follows_requires_dist_and_stops_at_the_gpu_machines_packages():
    index = Index(
        metadata("a", "1.0", "b>=1", "numpy", "old; python_version < '3.11'", "dev; extra == 'test'",
                 "win; sys_platform == 'win32'", "new; python_version >= '3.12'"),
        metadata("b", "1.0", "f", "click>=7"),
        metadata("f", "1.0"),
        metadata("new", "1.0"),
    )  # fmt: skip
    plan = resolve(roots("a"), {"numpy": Version("2.5.2"), "click": None}, index)
    assert plan.errors == []
    assert sorted(plan.brought) == ["a", "b", "f", "new"]
    assert plan.brought["f"].chain == ["elastictrain", "a 1.0", "b 1.0"]
    assert sorted(plan.present) == ["click", "numpy"]
    assert plan.present["click"] == ["b 1.0: click>=7"]
    assert "numpy" not in index.fetched and "click" not in index.fetched


def test_a_requirement_that_the_gpu_machines_version_violates_is_refused_not_brought_twice():
    index = Index(metadata("a", "1.0", "torch>=2.12"), metadata("torch", "2.12.0"))
    plan = resolve(roots("a"), {"torch": Version("2.11.0")}, index)
    assert len(plan.errors) == 1
    assert "a 1.0: torch>=2.12" in plan.errors[0] and "torch==2.11.0" in plan.errors[0]
    assert "second version" in plan.errors[0]
    assert "torch" not in plan.brought and index.fetched == ["a"]


def test_a_local_build_of_the_gpu_machines_version_meets_a_plain_specifier():
    plan = resolve(roots("torch>=2.4,<=2.14.1"), {"torch": Version("2.11.0+cu130")}, Index())
    assert plan.errors == [] and plan.brought == {}


def test_a_later_requirement_that_excludes_the_version_already_chosen_is_an_error():
    index = Index(metadata("a", "1.0", "b"), metadata("c", "1.0", "b>=2"), metadata("b", "1.0"))
    plan = resolve(roots("a", "c"), {}, index)
    assert plan.errors == ["c 1.0: b>=2 — conflicts with b==1.0 already chosen"]


def test_a_wheel_nobody_has_is_reported_with_the_requirement_that_asked():
    plan = resolve(roots("a"), {}, Index(metadata("a", "1.0", "missing>=3")))
    assert plan.errors == ["a 1.0: missing>=3 — no wheel for missing>=3"]


def test_extras_asked_by_a_requirement_bring_their_requirements():
    index = Index(metadata("a", "1.0", "b[fast]"), metadata("b", "1.0", "speed; extra == 'fast'"),
                  metadata("speed", "1.0"))  # fmt: skip
    assert sorted(resolve(roots("a"), {}, index).brought) == ["a", "b", "speed"]


def test_markers_are_those_of_cpython_312_on_linux_x86_64():
    text = metadata(
        "x", "1", "yes; platform_machine == 'x86_64' and sys_platform == 'linux'",
        "no; platform_system == 'Windows'", "no2; implementation_name == 'pypy'",
        "yes2; python_version < '3.13'",
    )  # fmt: skip
    assert [r.name for r in requirements(text, TARGET_ENV)] == ["yes", "yes2"]


def test_the_gpu_list_is_normalised_and_lacks_what_the_kit_brings():
    lines = [ln for ln in GPU_LIST.read_text().splitlines() if ln and not ln.startswith("#")]
    present = read_gpu_list(GPU_LIST)
    assert len(present) == len(lines) == 197
    assert all(ln.split("==")[0] == ln.split("==")[0].lower().replace("_", "-") for ln in lines)
    assert present["torch"] == Version("2.11.0") and present["peft"] is None
    assert not {"ray", "deepspeed", "omegaconf", "mlflow", "pydantic", "hjson"} & set(present)


def test_pyproject_dependencies_are_brought_core_only_or_named_as_left_out():
    brought, left = pyproject_roots()
    by_name = {str(req.name): req for req, _ in brought}
    assert by_name["ray"].extras == set()
    # pyproject's range, narrowed to the release constraints.txt says the suite ran with
    tested = constraints()["deepspeed"]
    assert f"=={tested}" in str(by_name["deepspeed"].specifier)
    assert set(by_name["deepspeed"].specifier.filter(["0.19.7", "0.19.8", "0.19.9", tested])) == {tested}
    assert {entry["name"] for entry in left} == {"mlflow", "datasets", "s3fs"}
    assert "mlflow" not in by_name


def _wheel(path: Path) -> Path:
    wheel = b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n"
    files = {"pkg/__init__.py": b"x = 1\n", "pkg/jars/big.jar": b"J" * 4096, "pkg/bin/tool": b"#!/bin/sh\n",
             "pkg-1.0.dist-info/METADATA": metadata("pkg", "1.0").encode(),
             "pkg-1.0.dist-info/WHEEL": wheel}  # fmt: skip
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, (2025, 1, 2, 3, 4, 6))
            info.external_attr = (0o755 if name.endswith("tool") else 0o644) << 16
            z.writestr(info, data)
        z.writestr("pkg-1.0.dist-info/RECORD", "stale,,\n")
    return path


def test_repack_drops_a_folder_rewrites_record_and_keeps_modes(tmp_path: Path):
    src = _wheel(tmp_path / "pkg-1.0-cp312-cp312-linux_x86_64.whl")
    dst = tmp_path / "out" / src.name
    dst.parent.mkdir()
    report = repack_wheel(src, dst, drop=["pkg/jars/"])
    assert report.dropped["pkg/jars/"] > 0 and report.after < report.before
    with zipfile.ZipFile(dst) as z:
        names = z.namelist()
        assert not any(n.startswith("pkg/jars/") for n in names)
        assert names[-1] == "pkg-1.0.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(z.read("pkg-1.0.dist-info/RECORD").decode())))
        assert [r[0] for r in rows] == names
        assert rows[-1] == ["pkg-1.0.dist-info/RECORD", "", ""]
        for name, digest, size in rows[:-1]:
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(data))
        assert z.getinfo("pkg/bin/tool").external_attr >> 16 == 0o755
        assert z.getinfo("pkg/__init__.py").date_time == (2025, 1, 2, 3, 4, 6)


def test_repack_refuses_to_strip_a_member_the_wheel_lacks(tmp_path: Path):
    src = _wheel(tmp_path / "pkg-1.0-cp312-cp312-linux_x86_64.whl")
    with pytest.raises(FileNotFoundError, match="pkg/missing.so"):
        repack_wheel(src, tmp_path / "x.whl", strip=["pkg/missing.so"])
