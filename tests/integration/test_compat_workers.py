"""The Ray workers import the same DeepSpeed as the driver: `make test-compat DEEPSPEED=X` puts another
release first on PYTHONPATH, and the tests it runs are only about that release if the workers see it."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.integration


def test_ray_workers_import_the_drivers_deepspeed(ray_local: None) -> None:
    import ray

    def _deepspeed_here() -> tuple[str, str]:
        # Defined here, so Ray ships it by value: a worker cannot import this test module.
        import importlib.util

        from elastictrain.compat.registry import installed_version

        spec = importlib.util.find_spec("deepspeed")
        assert spec is not None and spec.origin
        return str(installed_version("deepspeed")), spec.origin

    version, origin = _deepspeed_here()
    expected = os.environ.get("ELASTICTRAIN_EXPECT_DEEPSPEED")
    if expected:
        assert version == expected, f"the driver imports deepspeed {version} from {origin}"
    assert ray.get(ray.remote(_deepspeed_here).remote()) == (version, origin)
