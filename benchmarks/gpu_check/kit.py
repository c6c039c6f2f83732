"""The GPU kit: the wheels the GPU machine lacks for elastictrain, to install there offline.

    python -m benchmarks.gpu_check.kit build  [--kit .gpu-kit]
    python -m benchmarks.gpu_check.kit size   [--kit .gpu-kit] [--limit-mib 60]
    python -m benchmarks.gpu_check.kit verify [--kit .gpu-kit] [--python python3.12]

The GPU machine (Python 3.12.3, torch 2.11, no network) installs it with
`python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site
.gpu-kit/wheels/*.whl`, then runs with PYTHONPATH=/tmp/site:$REPO/src:$REPO. What it already has is
gpu_machine_packages.txt beside this file; the kit brings the closure of pyproject.toml's dependencies
over Requires-Dist, stopping there. At most 64 MiB travel to it, the working tree included: `size`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks.gpu_check.downloads import (
    MIB,
    RAY_DROP,
    RAY_STRIP,
    Downloader,
    deepspeed_build_info,
    local_versions,
    ray_repacked,
    say,
)
from benchmarks.gpu_check.wheels import TARGET_ENV, Plan, read_gpu_list, resolve, sha256_file

REPO = Path(__file__).resolve().parents[2]
GPU_LIST = Path(__file__).with_name("gpu_machine_packages.txt")
DEFAULT_KIT = REPO / ".gpu-kit"
CACHE = Path(os.environ.get("ELASTICTRAIN_GPU_KIT_CACHE", "~/.cache/elastictrain/gpu-kit-downloads"))

# Dependencies of pyproject.toml that the GPU check does without, and why.
NOT_BROUGHT = {
    "mlflow": "too big for the 64 MiB the GPU machine receives (mlflow, mlflow-skinny and their closure); "
    "the GPU check runs `elastictrain train --no-tracking`, which never imports it",
    "datasets": "only data.source=hf reads through it; the GPU check trains on generated data",
    "s3fs": "only a run.dir on S3 writes through it; the GPU check keeps run.dir on local disk",
}
# Brought without the extras pyproject.toml asks for.
CORE_ONLY = {
    "ray": "core only, no [train,default] extras: elastictrain uses core actors, placement groups, "
    "ray.util.scheduling_strategies and ray.exceptions, and starts its local cluster with "
    "include_dashboard=False",
}


# Brought at the exact release constraints.txt names (what the suite ran with), inside pyproject's range.
PINNED = {"deepspeed"}


def constraints() -> dict[str, str]:
    """constraints.txt's exact versions, by canonical name."""
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = version.strip()
    return out


def pyproject_roots() -> tuple[list[tuple[Requirement, str]], list[dict[str, str]]]:
    """pyproject.toml's dependencies to bring (extras dropped where CORE_ONLY says), and those not brought."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    who = f"elastictrain {project['version']}"
    roots, left = [], []
    exact = constraints()
    for line in project["dependencies"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({**TARGET_ENV, "extra": ""}):
            continue
        if name in NOT_BROUGHT:
            left.append({"name": name, "requirement": line, "why": NOT_BROUGHT[name]})
            continue
        if name in CORE_ONLY:
            req = Requirement(f"{req.name}{req.specifier}")
        if name in PINNED:
            req = Requirement(f"{req.name}{req.specifier},=={exact[name]}")
        roots.append((req, who))
    return roots, left


def recipe() -> str:
    """What the kit is made from: the GPU list, pyproject.toml's dependencies, and this code."""
    h = hashlib.sha256(GPU_LIST.read_bytes())
    h.update(
        json.dumps(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]).encode()
    )
    for module in ("kit.py", "downloads.py", "wheels.py"):
        h.update(Path(__file__).with_name(module).read_bytes())
    return h.hexdigest()


def kit_is_current(kit: Path) -> bool:
    """A kit built from the current recipe whose wheels are those its manifest lists, unaltered."""
    try:
        manifest = json.loads((kit / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    listed = {w["file"]: w["sha256"] for w in manifest.get("wheels", [])}
    present = {p.name for p in (kit / "wheels").glob("*.whl")}
    return (
        manifest.get("recipe") == recipe()
        and present == set(listed)
        and all(sha256_file(kit / "wheels" / f) == s for f, s in listed.items())
    )


def build(kit: Path, cache: Path, strip: bool = False) -> int:
    start = time.monotonic()
    present = read_gpu_list(GPU_LIST)
    roots, not_brought = pyproject_roots()
    say(f"{len(present)} distributions on the GPU machine ({GPU_LIST.name})")
    say(f"roots from pyproject.toml: {', '.join(str(r) for r, _ in roots)}")
    plan: Plan = resolve(roots, present, Downloader(cache, local_versions()), log=say)
    plan.errors += [f"{n} is brought by {' -> '.join(b.chain)} but {NOT_BROUGHT[n]}" for n, b in
                    plan.brought.items() if n in NOT_BROUGHT]  # fmt: skip
    if plan.errors:
        for error in plan.errors:
            print(f"error: {error}", file=sys.stderr)
        say(f"FAILED: {len(plan.errors)} requirement(s) cannot be met; the kit was not written")
        return 1
    notes, extra = [], {}
    wheels_dir = kit / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    for old in wheels_dir.glob("*.whl"):
        old.unlink()
    entries = []
    for name, b in sorted(plan.brought.items()):
        wheel, source = b.fetched.wheel, b.fetched.source
        if name == "ray":
            wheel, extra["ray_repack"] = ray_repacked(cache.expanduser(), wheel, strip)
            source += f"; repacked without {RAY_DROP}" + (f", {RAY_STRIP} stripped" if strip else "")
        if name == "deepspeed":
            extra["deepspeed_build"] = info = deepspeed_build_info(wheel)
            say(f"deepspeed torch_info={info.get('torch_info')}: {info['check']}")
            if not info["ok"]:
                print(f"error: deepspeed: {info['check']}", file=sys.stderr)
                return 1
        shutil.copyfile(wheel, wheels_dir / wheel.name)
        entries.append({
            "file": wheel.name, "name": name, "version": str(b.version),
            "size": wheel.stat().st_size, "sha256": sha256_file(wheel), "source": source,
            "why": " -> ".join([*b.chain, name]), "asked_by": b.asked_by,
        })  # fmt: skip
    if "omegaconf" in plan.brought and "antlr4-python3-runtime" not in plan.brought:
        with zipfile.ZipFile(plan.brought["omegaconf"].fetched.wheel) as z:
            if any(n.startswith("omegaconf/vendor/antlr4/") for n in z.namelist()):
                notes.append("antlr4-python3-runtime is not brought: this omegaconf vendors it "
                             "(omegaconf/vendor/antlr4) and does not require it")  # fmt: skip
    manifest = {
        "recipe": recipe(),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": "CPython 3.12 (GPU machine: 3.12.3), Linux x86_64, manylinux_2_17/2_28 or pure wheels",
        "gpu_list": str(GPU_LIST.relative_to(REPO)),
        "install": "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
        "--target /tmp/site .gpu-kit/wheels/*.whl",
        "total_bytes": sum(e["size"] for e in entries),
        "wheels": entries,
        "on_gpu_machine": [
            {"name": n, "version": str(present[n]) if present[n] else "unknown (unchecked)", "asked_by": who}
            for n, who in sorted(plan.present.items())
        ],  # fmt: skip
        "not_brought": not_brought + [{"name": f"{n} extras", "why": w} for n, w in CORE_ONLY.items()],
        "notes": notes,
        **extra,
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for e in entries:
        say(f"  {e['size'] / MIB:7.2f} MiB  {e['file']}")
    say(f"kit: {len(entries)} wheels, {manifest['total_bytes'] / MIB:.2f} MiB in {wheels_dir}")
    say(f"built in {time.monotonic() - start:.1f} s")
    return 0


def tree_bytes(repo: Path = REPO) -> int:
    """The working tree that travels: tracked files plus untracked files git does not ignore."""
    cmd = ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = subprocess.run(cmd, capture_output=True, check=True, timeout=60).stdout
    paths = {repo / p for p in out.decode().split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def size(kit: Path, limit_mib: float) -> int:
    kit_size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    tree = tree_bytes()
    total = kit_size + tree
    print(f"kit {kit_size / MIB:.2f} MiB + working tree {tree / MIB:.2f} MiB = {total / MIB:.2f} MiB "
          f"(limit {limit_mib:g} MiB)")  # fmt: skip
    if total > limit_mib * MIB:
        print(f"error: kit plus working tree is {total / MIB:.2f} MiB, above the {limit_mib:g} MiB limit "
              f"(the GPU machine receives at most 64 MiB)", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check.kit", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("build", "size", "verify"):
        p = sub.add_parser(command)
        p.add_argument("--kit", type=Path, default=DEFAULT_KIT)
        p.add_argument("--cache", type=Path, default=CACHE, help="download cache (default: %(default)s)")
        if command == "build":
            p.add_argument("--strip", action="store_true", help="strip ray's ELF binaries (-4.4 MiB)")
        if command == "size":
            p.add_argument("--limit-mib", type=float, default=60.0)
        if command == "verify":
            p.add_argument("--python", default=None, help="a Python 3.12 (default: python3.12, or pyenv's)")
            p.add_argument("--no-ray-start", action="store_true", help="import ray only; start no cluster")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args.kit, args.cache, strip=args.strip)
    if args.command == "size":
        return size(args.kit, args.limit_mib)
    from benchmarks.gpu_check.verify import verify

    return verify(args.kit, args.python, args.cache, ray_start=not args.no_ray_start)


if __name__ == "__main__":
    sys.exit(main())
