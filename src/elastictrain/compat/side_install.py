"""Install another release of a package into a folder of its own, for `make test-compat`:
`python -m elastictrain.compat.side_install transformers==5.25.0 .compat/transformers-5.25.0`.

The package goes in without its dependencies, then each of its dependencies that this environment does
not satisfy (transformers 5.25 wants a newer huggingface-hub, 5.0 httpx, 4.57 an older tokenizers) goes in
beside it, also without dependencies (and theirs, a few levels down). Put first on PYTHONPATH, the
folder stands for an environment with that release, while torch, numpy and everything else stay this
environment's own builds.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _pip(folder: Path, *specs: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "--upgrade", "--target", str(folder), *specs], check=True)


def _versions(folder: Path) -> dict[str, str]:
    """The distributions in `folder`, by normalized name -> version."""
    found = importlib.metadata.distributions(path=[str(folder)])
    return {canonicalize_name(d.name): d.version for d in found}


def unsatisfied(requirements: list[str], beside: dict[str, str] | None = None) -> list[str]:
    """Those of `requirements` (Requires-Dist lines; extras' and other platforms' dropped) that neither
    `beside` (name -> version, what the folder holds) nor this environment meets."""
    out = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = (beside or {}).get(canonicalize_name(req.name))
        if version is None:
            try:
                version = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                out.append(f"{req.name}{req.specifier}")
                continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name}{req.specifier}")
    return out


def side_install(spec: str, folder: Path) -> list[str]:
    """Install `spec` into `folder`, then whatever it (and what came with it) needs that this environment
    lacks; returns what came with it."""
    _pip(folder, spec)
    added: list[str] = []
    for _ in range(5):  # a dependency's dependencies, a few levels down
        beside = _versions(folder)
        wanted = {
            r
            for d in importlib.metadata.distributions(path=[str(folder)])
            for r in unsatisfied(list(d.requires or []), beside)
        }
        if not wanted:
            break
        _pip(folder, *sorted(wanted))
        added += sorted(wanted)
    return added


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m elastictrain.compat.side_install PACKAGE==VERSION FOLDER")
        return 2
    missing = side_install(argv[0], Path(argv[1]))
    print(f"{argv[0]} in {argv[1]}" + (f", with {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
