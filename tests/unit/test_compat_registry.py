"""elastictrain's patches of DeepSpeed & co (elastictrain/compat/): each declared with its kind, range,
what it gains a user, docstring and retirement note; each one's check passes on the installed releases;
outside the tested range (or with its target gone) a time or memory patch warns once and is skipped,
and one that correctness depends on refuses, naming itself and the version."""

from __future__ import annotations

import importlib
import os
import re
import warnings
from collections.abc import Iterator

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from elastictrain.compat import registry
from elastictrain.compat.registry import CompatError, CompatWarning, all_patches, installed_version

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(autouse=True)
def decided_afresh() -> Iterator[None]:
    registry.forget_decisions()
    yield
    registry.forget_decisions()  # what a test simulated must not decide for the next one


def _other_release(monkeypatch: pytest.MonkeyPatch, package: str, version: str) -> None:
    real = registry.installed_version
    monkeypatch.setattr(registry, "installed_version", lambda p: version if p == package else real(p))


def test_every_patch_is_declared_with_kind_range_gain_docstring_and_retirement_note():
    patches = all_patches()
    assert len(patches) >= 20
    for name, patch in patches.items():
        assert patch.kind in ("performance", "memory", "correctness"), name
        SpecifierSet(patch.tested)  # a valid range
        for part in ("What:", "Why:", "Retired by:"):
            assert part in patch.doc, f"{name}'s docstring ({patch.function}) says no {part!r}"
        assert patch.gains, f"{name} says nothing of what it gains a user"
        module, qualname = patch.function.split(":")
        found = importlib.import_module(module)
        for attr in qualname.split("."):
            found = getattr(found, attr)
        assert callable(found), name


def test_the_installed_deepspeed_is_in_the_tested_range_and_every_check_passes():
    version = installed_version("deepspeed")
    assert version is not None and Version(version) in SpecifierSet(registry.DEEPSPEED_TESTED)
    problems = {name: p.problem() for name, p in all_patches().items() if p.problem() is not None}
    assert problems == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped on a tested release
        assert all(registry.check_all().values())


def test_on_an_untested_deepspeed_a_performance_patch_warns_once_and_deepspeeds_own_code_runs(
    monkeypatch: pytest.MonkeyPatch,
):
    from elastictrain.compat.deepspeed.zero3_build import hooks_registered_without_gathering
    from elastictrain.compat.deepspeed.zero3_memory import share_fp32_partitions

    _other_release(monkeypatch, "deepspeed", "0.21.0")
    outside = r"grad_hooks_without_gather.*deepspeed 0\.21\.0 is outside"
    with pytest.warns(CompatWarning, match=outside), hooks_registered_without_gathering():
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        with hooks_registered_without_gathering():
            pass
    with pytest.warns(CompatWarning, match="fp32_partitions_shared"):
        assert share_fp32_partitions(engine=None) == 0  # skipped before it looks at the engine


def test_on_an_untested_deepspeed_a_correctness_patch_refuses_naming_itself_and_the_version(
    monkeypatch: pytest.MonkeyPatch,
):
    from elastictrain.compat.deepspeed.process_state import reset_zero_counters

    _other_release(monkeypatch, "deepspeed", "0.21.0")
    tested = re.escape(f"tested: deepspeed{registry.DEEPSPEED_TESTED}")
    with pytest.raises(CompatError, match=rf"zero3_counters_reset.*0\.21\.0.*{tested}"):
        reset_zero_counters()
    with pytest.raises(CompatError) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        registry.check_all(("deepspeed",))
    for name in ("zero3_counters_reset", "process_groups_forgotten", "zero3_optimizer_state_access"):
        assert name in str(refused.value)
    with pytest.raises(CompatError, match="zero3_counters_reset: deepspeed 0.21.0 is outside"):
        registry.refuse_unsupported_versions()  # the driver's check, before any worker starts


def test_a_removed_target_skips_a_memory_patch_and_refuses_a_correctness_one(monkeypatch: pytest.MonkeyPatch):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.utils import groups

    from elastictrain.compat.deepspeed.process_state import forget_process_groups
    from elastictrain.compat.deepspeed.zero3_build import freed_partitions_returned

    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_create_fp16_partitions_with_defragmentation")
    gone = "freed_partitions_returned.*_create_fp16_partitions_with_defrag"
    with pytest.warns(CompatWarning, match=gone), freed_partitions_returned():
        pass
    monkeypatch.delattr(groups, "_release_process_group_references", raising=False)
    monkeypatch.delattr(groups, "_WORLD_GROUP")
    with pytest.raises(CompatError, match="process_groups_forgotten.*_WORLD_GROUP"):
        forget_process_groups()


def test_without_deepspeeds_own_group_release_the_groups_are_forgotten_as_0_19_7_needs(
    monkeypatch: pytest.MonkeyPatch,
):
    # 0.19.7 has no groups._release_process_group_references (0.19.8's destroy calls it itself).
    import deepspeed.comm.comm as ds_comm_state
    from deepspeed.utils import groups

    from elastictrain.compat.deepspeed.process_state import forget_process_groups

    monkeypatch.delattr(groups, "_release_process_group_references", raising=False)
    monkeypatch.setattr(groups, "_WORLD_GROUP", object())
    monkeypatch.setattr(groups, "_DATA_PARALLEL_GROUP", object())
    monkeypatch.setattr(ds_comm_state, "cdb", object())
    monkeypatch.setitem(groups._EXPERT_PARALLEL_GROUP, "ep", object())
    forget_process_groups()
    assert groups._WORLD_GROUP is None and groups._DATA_PARALLEL_GROUP is None
    assert ds_comm_state.cdb is None and groups._EXPERT_PARALLEL_GROUP == {}


def test_a_check_sees_a_target_of_another_shape():
    def takes(self: object, other: object) -> None: ...

    def wrapper(self: object, *args: object) -> None: ...

    assert registry.has_parameters(takes, "self", "other") is None
    assert "expected (self, sub_group_id" in str(registry.has_parameters(takes, "self", "sub_group_id"))
    assert registry.has_parameters(wrapper, "self", "anything") is None  # a stand-in taking *args


def test_the_compatibility_page_lists_the_registrys_patches():
    from elastictrain.compat import table

    assert table.main(["--check"]) == 0, "run: python -m elastictrain.compat.table"


def test_a_patch_that_says_nothing_of_what_it_gains_cannot_be_declared():
    with pytest.raises(ValueError, match="gains"):
        registry.patch("gains_nothing", package="torch", kind="performance", check=lambda: None, gains=" ")
    assert "gains_nothing" not in registry.PATCHES


def test_the_compatibility_page_states_each_patchs_gain():
    from elastictrain.compat import table

    page = table.PAGE.read_text()
    for name, patch in all_patches().items():
        assert f"| `{name}` |" in page and patch.gains in page, name
