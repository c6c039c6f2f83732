"""The Ray workers import the same DeepSpeed and transformers as the driver: `make test-compat DEEPSPEED=X
TRANSFORMERS=Y` puts other releases first on PYTHONPATH, and the tests it runs are only about those
releases if the workers see them."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.integration


def test_ray_workers_import_the_drivers_deepspeed_and_transformers(ray_local: None) -> None:
    import ray

    def _releases_here() -> list[tuple[str, str]]:
        # Defined here, so Ray ships it by value: a worker cannot import this test module.
        import importlib.util

        from elastictrain.compat.registry import installed_version

        found = []
        for package in ("deepspeed", "transformers"):
            spec = importlib.util.find_spec(package)
            assert spec is not None and spec.origin
            found.append((str(installed_version(package)), spec.origin))
        return found

    here = _releases_here()
    for package, (version, origin) in zip(("deepspeed", "transformers"), here, strict=True):
        expected = os.environ.get(f"ELASTICTRAIN_EXPECT_{package.upper()}")
        if expected:
            assert version == expected, f"the driver imports {package} {version} from {origin}"
    assert ray.get(ray.remote(_releases_here).remote()) == here
