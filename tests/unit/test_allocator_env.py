"""The workers' malloc: Ray's jemalloc preloaded by default, the system's on request."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.cluster.allocator import JEMALLOC_CONF, allocator_env, jemalloc_library
from elastictrain.cluster.worker_resources import WorkerResources
from elastictrain.host.memory import running_allocator


def test_jemalloc_is_preloaded_from_rays_own_copy_with_purging_off():
    library = jemalloc_library()
    assert library is not None and Path(library).is_file()  # the installed Ray ships one
    assert allocator_env("jemalloc", {}) == {"LD_PRELOAD": library, "MALLOC_CONF": JEMALLOC_CONF}


def test_the_drivers_own_preloads_and_jemalloc_settings_are_kept():
    env = allocator_env("jemalloc", {"LD_PRELOAD": "/opt/libfoo.so", "MALLOC_CONF": "narenas:1"})
    assert env["LD_PRELOAD"] == f"{jemalloc_library()}:/opt/libfoo.so"
    assert env["MALLOC_CONF"] == "narenas:1"


def test_the_system_allocator_changes_nothing_and_an_unknown_one_is_named():
    assert allocator_env("system", {"LD_PRELOAD": "/opt/libfoo.so"}) == {}
    with pytest.raises(ValueError, match="worker_allocator: got 'tcmalloc'; expected one of jemalloc"):
        allocator_env("tcmalloc", {})


def test_worker_resources_carry_the_chosen_allocator(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    jemalloc = WorkerResources(False, 1, 0, "jemalloc").env_vars()
    assert jemalloc["LD_PRELOAD"] == jemalloc_library() and jemalloc["MALLOC_CONF"] == JEMALLOC_CONF
    assert "LD_PRELOAD" not in WorkerResources(False, 1, 0, "system").env_vars()


def test_a_process_says_which_malloc_it_has_mapped(tmp_path: Path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /x/ray/core/libjemalloc.so\n")
    assert running_allocator(str(maps)) == "jemalloc"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert running_allocator(str(maps)) == "system"
    assert running_allocator(str(tmp_path / "missing")) == "system"
