"""Where the GPU kit's wheels come from: the download cache, PyPI, a build of deepspeed's sdist, and
ray's repack (benchmarks/gpu_check/kit.py decides which; wheels.py holds what these build on)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from benchmarks.gpu_check.wheels import (
    MORE_PLATFORMS,
    PLATFORMS,
    Fetched,
    FetchError,
    repack_wheel,
    sha256_file,
    wheel_fits,
    wheel_metadata,
)

MIB = 1 << 20
# PyPI has only an sdist: built here as a pure wheel, its ops left to compile at first use on the GPU.
BUILT_FROM_SDIST = {"deepspeed"}
# Ray's wheel less what elastictrain never loads: Java (ray/jars, 31 MiB of the 76 compressed). With
# `build --strip`, also the symbols of its ELF binaries (4.4 MiB; only C++ crash backtraces read them):
# not needed while kit and tree fit the limit without it, and kept for readable backtraces.
RAY_DROP = ["ray/jars/"]
RAY_STRIP = [
    "ray/_raylet.so",
    "ray/core/src/ray/gcs/gcs_server",
    "ray/core/src/ray/raylet/raylet",
    "ray/core/libjemalloc.so",
]


def say(line: str) -> None:
    print(f"[gpu-kit] {line}", flush=True)


def local_versions() -> dict[str, Version]:
    """This interpreter's distributions (the venv the tests run in): the versions the kit prefers."""
    found: dict[str, Version] = {}
    for dist in importlib.metadata.distributions():
        try:
            found[canonicalize_name(dist.metadata["Name"])] = Version(dist.version)
        except (InvalidVersion, TypeError):
            continue
    return found


class Downloader:
    """Fetches a cp312 manylinux x86_64 wheel for a requirement, from the cache folder or PyPI.

    Prefers the version installed in this venv (what the tests exercise) when the requirement allows it.
    """

    def __init__(self, cache: Path, pins: dict[str, Version]) -> None:
        self.cache, self.pins = cache.expanduser(), pins
        self.cache.mkdir(parents=True, exist_ok=True)

    def __call__(self, req: Requirement) -> Fetched:
        name = canonicalize_name(req.name)
        pin = self.pins.get(name)
        if pin is not None and not req.specifier.contains(pin, prereleases=True):
            pin = None
        if name in BUILT_FROM_SDIST:
            return self._built(name, req, pin)
        if pin is not None and (hit := self._cached(name, pin)) is not None:
            return Fetched(hit, wheel_metadata(hit), self._source(hit))
        specs = ([f"{name}=={pin}"] if pin is not None else []) + [f"{name}{req.specifier}"]
        errors = []
        for platforms in (PLATFORMS, PLATFORMS + MORE_PLATFORMS):
            for spec in specs:
                try:
                    wheel = self._pip_download(spec, platforms)
                    return Fetched(wheel, wheel_metadata(wheel), self._source(wheel))
                except FetchError as e:
                    errors.append(str(e))
        raise FetchError(f"no cp312 manylinux x86_64 or pure wheel on PyPI: {errors[-1]}")

    def _cached(self, name: str, version: Version) -> Path | None:
        for path in sorted(self.cache.glob("*.whl")):
            got, ver, _, _ = parse_wheel_filename(path.name)
            if got == name and ver == version and wheel_fits(path, PLATFORMS + MORE_PLATFORMS):
                return path
        return None

    @staticmethod
    def _source(wheel: Path) -> str:
        if wheel_fits(wheel, PLATFORMS):
            return "PyPI"
        return (
            f"PyPI, tagged for a newer glibc than manylinux_2_28 (ok on the GPU machine's 2.39): {wheel.name}"
        )

    def _pip_download(self, spec: str, platforms: list[str]) -> Path:
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
            cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
            cmd += [a for p in platforms for a in ("--platform", p)] + ["-d", tmp, spec]
            say(f"download {spec}")
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            files = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or len(files) != 1:
                raise FetchError(f"pip download {spec}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            return Path(shutil.move(files[0], self.cache / files[0].name))

    def _built(self, name: str, req: Requirement, pin: Version | None) -> Fetched:
        exact = [s.version for s in req.specifier if s.operator == "=="]
        version = str(pin) if pin is not None else (exact[0] if exact else None)
        if version is None:
            raise FetchError(f"{name} is built from its sdist: pyproject.toml must pin one version")
        source = "built here from the PyPI sdist, DS_BUILD_OPS=0 (pure: ops JIT-compile on the GPU)"
        if (hit := self._cached(name, Version(version))) is not None:
            return Fetched(hit, wheel_metadata(hit), source)
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            say(f"build {name}=={version} from its sdist (DS_BUILD_OPS=0)")
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
            cmd += ["--no-cache-dir", "-w", tmp, f"{name}=={version}"]
            env = {**os.environ, "DS_BUILD_OPS": "0"}
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            files = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or len(files) != 1:
                raise FetchError(f"building {name}=={version}: {done.stderr.strip()[-500:]}")
            if not files[0].name.endswith("-py3-none-any.whl"):
                raise FetchError(f"building {name}=={version} gave {files[0].name}, not a py3-none-any wheel")
            wheel = Path(shutil.move(files[0], self.cache / files[0].name))
        return Fetched(wheel, wheel_metadata(wheel), source)


def deepspeed_build_info(wheel: Path) -> dict[str, object]:
    """The literals of deepspeed/git_version_info_installed.py in the wheel (torch_info, installed_ops)."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read("deepspeed/git_version_info_installed.py"))
    info: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            info[node.targets[0].id] = ast.literal_eval(node.value)
    ops = info.get("installed_ops", {})
    prebuilt = sorted(k for k, v in ops.items() if v) if isinstance(ops, dict) else ["?"]
    info["check"] = (
        f"prebuilt ops {prebuilt}: DeepSpeed would compare torch_info with the GPU machine's torch"
        if prebuilt
        else "no op is prebuilt: OpBuilder.load() checks torch_info (torch and CUDA version) only for a "
        "prebuilt op, so every op JIT-compiles against the GPU machine's torch 2.11+cu130, unchecked"
    )
    info["ok"] = not prebuilt
    return info


def ray_repacked(cache: Path, original: Path, strip: bool) -> tuple[Path, dict[str, object]]:
    """Ray's wheel without RAY_DROP (and RAY_STRIP stripped if strip), cached by source and recipe."""
    strip_list = RAY_STRIP if strip else []
    key = {"source_sha256": sha256_file(original), "drop": RAY_DROP, "strip": strip_list}
    out = cache / "repacked" / ("stripped" if strip else "unstripped") / original.name
    note = out.with_suffix(".json")
    if out.exists() and note.exists() and json.loads(note.read_text()).get("key") == key:
        return out, json.loads(note.read_text())["report"]
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"repack {original.name}: drop {RAY_DROP}, strip --strip-unneeded {strip_list}")
    rep = repack_wheel(original, out, RAY_DROP, strip_list)
    report: dict[str, object] = {
        "original_mib": round(rep.before / MIB, 2),
        "repacked_mib": round(rep.after / MIB, 2),
        "dropped_mib": {k: round(v / MIB, 2) for k, v in rep.dropped.items()},
        "strip_saved_mib": {k: round((a - b) / MIB, 2) for k, (a, b) in rep.stripped.items()},
    }
    note.write_text(json.dumps({"key": key, "report": report}, indent=1))
    return out, report
