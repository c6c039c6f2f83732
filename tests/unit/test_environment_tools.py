"""Every elastictrain process finds the environment's own tools (ninja) first on PATH, and its own
DeepSpeed op cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastictrain.compat.deepspeed import cpu_info, ops
from elastictrain.compat.deepspeed.ops import own_extensions_dir, prefer_environment_tools


def test_the_interpreters_bin_folder_goes_first_once(monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", bin_dir, "/bin"]))
    prefer_environment_tools()
    prefer_environment_tools()
    assert os.environ["PATH"].split(os.pathsep) == [bin_dir, "/usr/bin", "/bin"]


def test_deepspeed_ops_are_cached_per_environment_unless_the_user_says_where(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    prefer_environment_tools()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(own_extensions_dir())
    assert own_extensions_dir().parent == Path.home() / ".cache" / "torch_extensions"
    assert f"py{sys.version_info.major}{sys.version_info.minor}" in own_extensions_dir().name

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    prefer_environment_tools()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"


def test_another_installs_cache_inherited_from_its_process_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process of another environment set it for its own DeepSpeed: compiling this one's ops there
    # would make that environment compile its own again.
    other = own_extensions_dir().parent / "elastictrain-py311-000000000000"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(other))
    prefer_environment_tools()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(own_extensions_dir())


def test_an_arch_specific_cuda_target_does_not_stop_deepspeeds_op_builders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A GPU image set TORCH_CUDA_ARCH_LIST="9.0a": DeepSpeed's async I/O builder (NVMe offload) raised
    # "invalid literal for int() with base 10: '0a'" before compiling anything.
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX")
    with pytest.raises(ValueError, match="0a"):
        AsyncIOBuilder().compute_capability_args()
    prefer_environment_tools()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    builder = AsyncIOBuilder()
    builder.jit_mode = True
    builder.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"


def test_plain_cuda_targets_and_separators_are_kept() -> None:
    assert ops.arch_list_deepspeed_reads("7.5 8.6 9.0+PTX") == "7.5 8.6 9.0+PTX"
    assert ops.arch_list_deepspeed_reads("9.0a 10.0f") == "9.0 10.0"


def test_two_deepspeed_installs_do_not_share_an_op_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two checkouts' environments compile the same op from different paths: sharing one cache, each
    # took the other's build for stale and rebuilt every op.
    def install_at(folder: str) -> Path:
        spec = SimpleNamespace(origin=f"{folder}/site-packages/deepspeed/__init__.py")
        monkeypatch.setattr(ops.importlib.util, "find_spec", lambda name: spec)
        return own_extensions_dir()

    first, second = install_at("/work/main/.venv/lib"), install_at("/check/work/main/.venv/lib")
    assert first != second
    assert install_at("/work/main/.venv/lib") == first


def test_the_cpu_is_probed_once_per_process_and_every_caller_gets_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess

    import cpuinfo

    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # undone after the test
    cpu_info.remember_cpu_info()
    cpuinfo.get_cpu_info()  # the first call probes, in a subprocess

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("py-cpuinfo started a subprocess again")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)  # py-cpuinfo imports it at each probe
    cpu_info.remember_cpu_info()
    from cpuinfo import get_cpu_info  # as DeepSpeed imports it, at each call

    first, second = get_cpu_info(), get_cpu_info()
    assert first == second and first is not second
    assert first["arch"]
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    assert CPUAdamBuilder().cpu_arch().startswith("-m")  # DeepSpeed's compiler flags, from the copy


def test_the_cpu_probe_is_saved_for_this_cpu_and_read_back_instead_of_probing_again(tmp_path: Path) -> None:
    probes: list[int] = []

    def probe() -> dict[str, object]:
        probes.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}

    first = cpu_info.cpu_info_from_file(probe, tmp_path)
    again = cpu_info.cpu_info_from_file(probe, tmp_path)
    assert first == again == {"arch": "X86_64", "flags": ["avx2"]}
    assert len(probes) == 1
    [saved] = tmp_path.glob("cpuinfo-*.json")
    assert saved.name == f"cpuinfo-{cpu_info.cpu_fingerprint()}.json"  # another CPU reads another file
    saved.write_text("{not json")  # a torn or foreign file is probed over, not trusted
    assert cpu_info.cpu_info_from_file(probe, tmp_path) == first and len(probes) == 2
