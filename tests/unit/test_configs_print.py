"""Every config in conf/ and examples/ (those added later too: they are globbed) passes `--print-config`.

They are checked from a folder laid out as the repository root, where a user runs them, after each
example's own `prepare.py work/` has made the folders its configs name (as its README says).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import yaml
from readme_blocks import REPO
from typer.testing import CliRunner

from elastictrain.cli import app

CONFIGS = sorted({*REPO.glob("conf/**/*.yaml"), *REPO.glob("examples/**/*.yaml")})


@pytest.fixture(scope="module")
def repo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("root")
    for name in ("conf", "examples"):
        (root / name).symlink_to(REPO / name)
    for prepare in sorted(REPO.glob("examples/*/prepare.py")):  # `python examples/X/prepare.py work/`
        argv, sys.argv = sys.argv, [str(prepare), str(root / "work")]
        try:
            runpy.run_path(str(prepare), run_name="__main__")
        finally:
            sys.argv = argv
    return root


def test_the_configs_are_found():
    names = {p.relative_to(REPO).as_posix() for p in CONFIGS}
    assert {"conf/tiny-cpu.yaml", "examples/plain_module/config.yaml"} <= names, names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_config_passes_print_config(config: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(repo_root)
    rel = config.relative_to(REPO).as_posix()
    result = CliRunner().invoke(app, ["train", "-c", rel, "--print-config"])
    assert result.exit_code == 0, f"elastictrain train -c {rel} --print-config:\n{result.output}"
    printed = yaml.safe_load(result.output)
    assert {"run", "model", "data", "training", "scaling"} <= set(printed), result.output
    assert not (repo_root / "runs").exists(), "--print-config must not create a run folder"
