"""The packages keep to their rooms: Ray behind two doors, no two packages importing each other.

Read from the source with `ast`, so a new module that breaks a rule fails here by name.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "elastictrain"

# Every Ray call on the driver lives in cluster/; inside an actor, in worker/ray_calls.py.
RAY_DOORS = ("cluster/", "worker/ray_calls.py")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """Every module name `path` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _room(path: Path) -> str:
    """The top-level package (or module) of elastictrain that `path` belongs to."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in _modules():
        room = _room(path)
        for name in _imported(path):
            if name.startswith("elastictrain."):
                target = name.split(".")[1]
                if target != room:
                    edges[room].add(target)
    return edges


def test_only_the_cluster_package_and_the_actors_ray_calls_module_import_ray():
    outside = [
        str(path.relative_to(PACKAGE))
        for path in _modules()
        if any(n == "ray" or n.startswith("ray.") for n in _imported(path))
        and not str(path.relative_to(PACKAGE)).startswith(RAY_DOORS)
    ]
    assert outside == [], f"these modules import ray outside {RAY_DOORS}: {outside}"


def test_no_two_packages_import_each_other():
    edges = _package_edges()
    pairs = sorted({tuple(sorted((a, b))) for a, bs in edges.items() for b in bs if a in edges.get(b, ())})
    assert pairs == [], f"packages importing each other: {pairs}"


def test_storage_does_not_import_the_run_folder():
    # rundir/ is built on storage/ (a run folder may be an s3:// URL), never the other way round.
    assert "rundir" not in _package_edges()["storage"]


def test_the_cycle_finder_sees_a_cycle():
    # Guards the guard: config imports data (formats), so data importing config would be a cycle.
    edges = _package_edges()
    assert "data" in edges["config"]
    assert "config" not in edges["data"]
