"""`kit verify`: install the GPU kit as the GPU machine does, into a clean target, and check it.

(a) one version of each distribution, none also on the GPU machine; (b) every Requires-Dist met by the kit
or the GPU machine; (c) ray, omegaconf, hjson and pydantic import (and a Ray cluster runs actors in a
placement group) with the GPU machine's own distributions stood in for by their wheels; deepspeed, which
cannot import without torch, compiles and has no prebuilt op; (d) a summary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from benchmarks.gpu_check.downloads import Downloader, deepspeed_build_info, local_versions, say
from benchmarks.gpu_check.kit import GPU_LIST
from benchmarks.gpu_check.wheels import metadata_name_version, read_gpu_list, requirements, resolve

ENV_SCRIPT = """import json, os, platform, sys
v = sys.implementation.version
print(json.dumps({"implementation_name": sys.implementation.name,
    "implementation_version": f"{v.major}.{v.minor}.{v.micro}", "os_name": os.name,
    "platform_machine": platform.machine(),
    "platform_python_implementation": platform.python_implementation(),
    "platform_release": platform.release(), "platform_system": platform.system(),
    "platform_version": platform.version(), "python_full_version": platform.python_version(),
    "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}))
"""
IMPORT_SCRIPT = """import sys, time
import hjson, omegaconf, pydantic, ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
assert omegaconf.OmegaConf.create({"a": 3, "b": "${a}"}).b == 3  # interpolation: the vendored antlr4
class M(pydantic.BaseModel):
    x: int
assert M(x="2").x == 2 and hjson.loads("{a: 1}")["a"] == 1
print("imported ray", ray.__version__, "omegaconf", omegaconf.__version__, "pydantic", pydantic.VERSION)
if sys.argv[1:] == ["start"]:
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    @ray.remote(num_cpus=1)
    class Worker:
        def ping(self):
            import os
            return sys.version_info[:2], os.environ.get("KIT_CHECK")
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    in_pg = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(2)]
    ws = [Worker.options(scheduling_strategy=s, runtime_env={"env_vars": {"KIT_CHECK": "1"}}).remote()
          for s in in_pg]
    node = ray.get_runtime_context().get_node_id()
    ws.append(Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote())
    replies = ray.get([w.ping.remote() for w in ws], timeout=180)
    assert replies[:2] == [(sys.version_info[:2], "1")] * 2, replies
    ray.kill(ws[0])
    for _ in range(60):  # ray.kill is asynchronous: a call right after it may still be answered
        try:
            ray.get(ws[0].ping.remote(), timeout=60)
        except RayActorError:
            break
        time.sleep(1)
    else:
        raise AssertionError("an actor killed a minute ago still answers")
    remove_placement_group(pg)
    ray.shutdown()
    print("ray cluster ran", len(replies), "actors (2 in a placement group);",
          "a killed one raised RayActorError")
"""


def find_python312(given: str | None = None) -> str | None:
    """A Python 3.12 that runs: given, else python3.12 on PATH, else pyenv's (also when given is the
    bare `python3.12` that a pyenv shim answers with 'command not found')."""
    home = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [given or "python3.12"]
    if candidates[0] == "python3.12":
        candidates += map(str, sorted(home.glob("versions/3.12*/bin/python3.12")))
    for candidate in candidates:
        exe = shutil.which(candidate) if candidate else None
        if exe is None:
            continue
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=60)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return exe
    return None


def gpu_version_of(req: Requirement, present: dict[str, Version | None]) -> Requirement:
    """req, pinned to the GPU machine's version where the list knows it."""
    known = present.get(canonicalize_name(req.name))
    return Requirement(f"{req.name}=={known}" if known else f"{req.name}{req.specifier}")


def pip_target(python: str, target: Path, wheels: list[Path]) -> None:
    """Exactly the GPU machine's install command."""
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    done = subprocess.run([*cmd, "--target", str(target), *map(str, wheels)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pip install --target {target} failed: {done.stderr.strip()[-2000:]}")


def installed(target: Path) -> dict[str, list[tuple[Version, str]]]:
    found: dict[str, list[tuple[Version, str]]] = {}
    for info in sorted(target.glob("*.dist-info")):
        metadata = (info / "METADATA").read_text()
        name, version = metadata_name_version(metadata)
        found.setdefault(name, []).append((version, metadata))
    return found


def verify(kit: Path, python: str | None, cache: Path, ray_start: bool = True) -> int:
    start = time.monotonic()
    exe = find_python312(python)
    if exe is None:
        print(
            f"error: no Python 3.12 found ({python or 'python3.12, ~/.pyenv/versions/3.12*'})",
            file=sys.stderr,
        )
        return 2
    wheels = sorted((kit / "wheels").glob("*.whl"))
    if not wheels:
        print(f"error: no wheels in {kit / 'wheels'}: run `build` first", file=sys.stderr)
        return 2
    present = read_gpu_list(GPU_LIST)
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-kit-verify-") as tmp:
        target, stand_in = Path(tmp) / "site", Path(tmp) / "gpu-machine"
        say(f"install {len(wheels)} wheels with {exe} into a clean --target")
        try:
            pip_target(exe, target, wheels)
        except RuntimeError as e:
            print(f"FAIL the GPU machine's install command: {e}", file=sys.stderr)
            return 1
        dists = installed(target)
        env = json.loads(subprocess.run([exe, "-c", ENV_SCRIPT], capture_output=True, text=True, check=True,
                                        timeout=60).stdout)  # fmt: skip
        # (a)
        for name, versions in sorted(dists.items()):
            if len(versions) > 1:
                failures.append(
                    f"(a) {name}: {len(versions)} versions in the target {[str(v) for v, _ in versions]}"
                )
            if name in present:
                failures.append(
                    f"(a) {name} is in the kit but the GPU machine has it already (second version)"
                )
        # (b)
        unchecked: set[str] = set()
        for name, [(version, metadata), *_] in sorted(dists.items()):
            for req in requirements(metadata, env):
                dep = canonicalize_name(req.name)
                have = dists[dep][0][0] if dep in dists else present.get(dep)
                if dep not in dists and dep not in present:
                    failures.append(
                        f"(b) {name} {version} requires {req}: neither the kit nor the GPU machine has it"
                    )
                elif have is None:
                    unchecked.add(dep)
                elif not req.specifier.contains(have, prereleases=True):
                    failures.append(f"(b) {name} {version} requires {req}, but {dep} is {have}")
        # (c) the GPU machine's own distributions that the importable ones need, from their wheels
        roots = [
            (gpu_version_of(r, present), f"{name} {version}")
            for name, [(version, metadata), *_] in dists.items() if name != "deepspeed"
            for r in requirements(metadata, env) if canonicalize_name(r.name) in present
        ]  # fmt: skip
        plan = resolve(
            roots, {n: v[0][0] for n, v in dists.items()}, Downloader(cache, local_versions()), env
        )
        failures += [f"(c) stand-in for the GPU machine: {e}" for e in plan.errors]
        if not plan.errors:
            say(f"stand in for the GPU machine's {sorted(plan.brought)}")
            pip_target(exe, stand_in, [b.fetched.wheel for b in plan.brought.values()])
            py_env = {
                **os.environ,
                "PYTHONPATH": f"{target}:{stand_in}",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            }
            args = [exe, "-c", IMPORT_SCRIPT] + (["start"] if ray_start else [])
            done = subprocess.run(args, capture_output=True, text=True, timeout=420, env=py_env, cwd=tmp)
            print(done.stdout.strip())
            if done.returncode != 0:
                failures.append(f"(c) import ray, omegaconf, hjson, pydantic: {done.stderr.strip()[-3000:]}")
        if "deepspeed" in dists:
            compile_ds = [exe, "-m", "compileall", "-q", str(target / "deepspeed")]
            done = subprocess.run(compile_ds, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                failures.append(f"(c) deepspeed does not compile under {exe}: {done.stdout[-2000:]}")
            ds_wheel = next(w for w in wheels if w.name.startswith("deepspeed-"))
            info = deepspeed_build_info(ds_wheel)
            ds_version = dists["deepspeed"][0][0]
            print(f"deepspeed {ds_version}: compiles; torch_info={info.get('torch_info')}; {info['check']}")
            if not info["ok"]:
                failures.append(f"(c) deepspeed: {info['check']}")
    # (d)
    size = sum(w.stat().st_size for w in wheels) / (1 << 20)
    say(f"{len(wheels)} wheels ({size:.2f} MiB) -> {len(dists)} distributions: {', '.join(sorted(dists))}")
    if unchecked:
        say(f"met by the GPU machine at an unlisted version (unchecked): {', '.join(sorted(unchecked))}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    say(f"verify {'FAILED' if failures else 'passed'} in {time.monotonic() - start:.1f} s")
    return 1 if failures else 0
