"""Where a run folder lives: a path or a URL, told apart and handled like a path (no store needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.config import ConfigError, load_config
from elastictrain.rundir.lock import lock_path
from elastictrain.rundir.run_dir import local_state_dir
from elastictrain.storage import ObjectPath, as_path, is_url, storage_of


def test_a_url_is_an_object_path_and_anything_else_a_local_path() -> None:
    assert isinstance(as_path("s3://bucket/runs/tiny"), ObjectPath)
    assert isinstance(as_path("gs://bucket/runs"), ObjectPath)
    assert as_path("runs/tiny") == Path("runs/tiny")
    assert as_path("file:///tmp/runs") == Path("/tmp/runs")
    assert not is_url("/abs/path") and not is_url("relative:colon") and is_url("s3://b/k")
    assert storage_of(as_path("s3://b/k")).renames_atomically is False
    assert storage_of(as_path("/tmp/x")).renames_atomically is True


def test_an_object_path_joins_and_names_like_a_path() -> None:
    run = as_path("s3://bucket/runs/tiny/")  # a trailing slash names the same folder
    assert str(run) == "s3://bucket/runs/tiny" and run == as_path("s3://bucket/runs/tiny")
    ck = run / "checkpoints" / "step-000004"
    assert str(ck) == "s3://bucket/runs/tiny/checkpoints/step-000004"
    assert (ck.name, str(ck.parent)) == ("step-000004", "s3://bucket/runs/tiny/checkpoints")
    for name in ("rank-00000-of-00002.safetensors", "manifest.json", ".tiny.driver-lock", "latest", ".x"):
        assert (ck / name).suffix == Path(name).suffix, name  # what the crash points go by
    assert str(run.with_name("tiny.old")) == "s3://bucket/runs/tiny.old"
    # The lock sits beside the folder, as for a local one.
    assert str(lock_path(run)) == "s3://bucket/runs/.tiny.driver-lock"


def test_what_stays_on_the_driver_of_a_run_on_an_object_store_has_one_local_folder_per_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICTRAIN_CACHE", str(tmp_path))
    assert local_state_dir(as_path("s3://bucket/runs/tiny")) == tmp_path / "object-runs/s3/bucket/runs/tiny"
    assert local_state_dir(tmp_path / "run") == tmp_path / "run"  # a local run folder keeps it inside


def test_a_url_whose_store_has_no_fsspec_package_is_a_config_error_naming_run_dir() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["run.dir=nosuchstore://bucket/run"])
    assert "run.dir: got 'nosuchstore://bucket/run'" in str(e.value)


def test_a_lora_adapter_cannot_be_exported_to_an_object_store() -> None:
    with pytest.raises(
        ConfigError, match=r"model.lora.export_dir: got 's3://b/run/adapter'; expected a local"
    ):
        load_config(None, ["run.dir=s3://b/run", "model.lora.enabled=true"])
