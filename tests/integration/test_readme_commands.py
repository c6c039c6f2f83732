"""Every shell block of the READMEs and of the manual under docs/ runs, in order, in a fresh copy of the
repository, as a user types it.

Blocks are found by Sybil (tests/readme_blocks.py). A block the page marks "Not run by the README
test" is only checked for its reason. The rest run in one shell per README, and in one shell for all
of docs/ in the order of the site's navigation, so that a run one page makes serves the pages after it
(exported variables and the current folder carry over from block to block), each bounded in time; a
failure names the page and line. The commands are the pages'; the substitutions below only fill in
what a user would choose (free ports, a folder of their own) or shorten a run (fewer steps), and each
must still match its page, so none goes stale silently.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import TEST_MODULE_ROOTS
from readme_blocks import REPO, ShellSession, Step, Substitution, docs_pages, free_ports, readmes, steps

pytestmark = pytest.mark.integration

VENV = Path(sys.prefix)
# A run as short as the commands allow: startup, a few steps, a checkpoint, the end.
SHORT = "training.warmup_steps=1 checkpoint.every_steps=2 data.generated_chars=40000"


def _ray_start_ports(temp_dir: Path, p: list[int]) -> str:
    """What a user leaves at Ray's defaults; free ones here, so no other cluster on this machine is met."""
    return (
        f"--port={p[0]} --ray-client-server-port={p[1]} --node-manager-port={p[2]} "
        f"--object-manager-port={p[3]} --dashboard-agent-listen-port={p[4]} "
        f"--dashboard-agent-grpc-port={p[5]} --metrics-export-port={p[6]} --runtime-env-agent-port={p[7]} "
        f"--temp-dir={temp_dir} --object-store-memory=100000000"
    )


DOCS = REPO / "docs"  # stands for every page of docs/, run in one shell in the nav's order


def substitutions(readme: Path, ray_temp: Path) -> list[Substitution]:
    name = readme.relative_to(REPO).as_posix()
    if name == "docs":
        *ports, dashboard = free_ports(9)
        return [
            # Before `=20`, which is its prefix.
            Substitution("training.max_steps=200", "training.max_steps=2", "no steps to add"),
            Substitution("training.max_steps=20", f"training.max_steps=2 {SHORT}", "a shorter first run"),
            Substitution(
                "training.max_steps=30",
                "training.max_steps=2",
                "no steps to add, so no second cold start (extending is tested in test_resume.py)",
            ),
            Substitution('"training.max_steps=50"', '"training.max_steps=4"', "a shorter run"),
            Substitution("training.max_steps=40", f"training.max_steps=2 {SHORT}", "a shorter run"),
            Substitution(
                "--num-cpus=2",
                f"--num-cpus=2 {_ray_start_ports(ray_temp, ports)} --dashboard-port={dashboard}",
                "Ray's default ports and /tmp/ray may be another cluster's on this machine",
            ),
            Substitution("127.0.0.1:8265", f"127.0.0.1:{dashboard}", "the dashboard port chosen above"),
        ]
    if name == "README.md":
        make = f"make -o {VENV}/bin/elastictrain VENV={VENV}"
        return [
            Substitution(
                "make install run ",
                f'{make} install run ARGS="training.max_steps=2 {SHORT}" ',
                "the venv the test runs in stands for the one `make install` makes (9 minutes)",
            ),
            Substitution(
                "make test ",
                f"{make} test TEST_WORKERS=0 PYTEST_ARGS=tests/unit/test_core_policy.py ",
                "the whole suite is what runs this test: one file of it, in one process",
            ),
            Substitution(
                "training.max_steps=60",
                "training.max_steps=2",
                "no steps to add, so no second cold start (extending is tested in test_resume.py)",
            ),
        ]
    return []


def _fresh_copy(dest: Path) -> Path:
    """The repository's files as a fresh clone has them (tracked and new, none that git ignores)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (p.decode() for p in listed)):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _same_ninja(home: Path) -> str:
    """A PATH entry holding only the `ninja` the rest of the suite uses, if any, to put before the venv.

    pip puts another ninja version in the venv's bin, and two ninja versions each rebuild every
    DeepSpeed op the other built (minutes each): the ops `make install` built must stay valid.
    """
    ninja = shutil.which("ninja")
    if ninja is None:
        return ""
    shim = home.parent / "ninja-bin"
    shim.mkdir(exist_ok=True)
    (shim / "ninja").symlink_to(ninja)
    return f"{shim}{os.pathsep}"


def _user_env(home: Path) -> dict[str, str]:
    """A user's shell on a fresh machine: the venv active, no Ray cluster or token chosen yet."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "PYTEST", "ELASTICTRAIN_", "MLFLOW_"))
    }
    env.update(
        PATH=f"{_same_ninja(home)}{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(VENV),
        HOME=str(home),  # no ~/.ray/auth_token of an earlier cluster: the README must make its own
        # Caches stay the user's: DeepSpeed's ops compiled by `make install` (minutes to build again).
        XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")),
    )
    # A checkout run without installing it: its code, as in the copy. Not the suite's own module folders
    # (helpers.TEST_MODULE_ROOTS): a user has none of them.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in TEST_MODULE_ROOTS]
    env.pop("PYTHONPATH", None)
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


@pytest.fixture
def user() -> Iterator[tuple[Path, Path, dict[str, str], Path]]:
    # Its own folder, not tmp_path: pytest prunes old tmp_path folders when other runs of this user
    # start, which a shared machine sees during this long test. Short: Ray's socket paths live under
    # its temp dir and must fit in 107 characters.
    root = Path(tempfile.mkdtemp(prefix="etdoc-", dir="/tmp"))
    try:
        (root / "home").mkdir()
        (root / "ray").mkdir()
        yield _fresh_copy(root / "repo"), root / "ray", _user_env(root / "home"), root / "shell"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _finished(repo: Path, name: str, last_step: int) -> dict[str, Any]:
    info = json.loads((repo / "runs" / name / "run.json").read_text())
    assert (info["status"], info["last_step"]) == ("FINISHED", last_step), (name, info)
    return info


def _plain_module_outcomes(repo: Path) -> None:
    """What its README promises: three runs of 20 steps, FINISHED; the model learned."""
    for name in ("plain-module", "on-ray"):
        _finished(repo, name, 20)
    info = _finished(repo, "from-python", 20)  # elastictrain.fit with the objects themselves
    # The targets have variance ~0.5; a model that learned nothing stays there.
    assert info["last_metrics"]["loss"] < 0.2, info["last_metrics"]
    assert (repo / "runs" / "from-python" / "checkpoints" / "step-000020" / "manifest.json").is_file()


def _hf_causal_lm_outcomes(repo: Path) -> None:
    """The fine-tune learned the example's grammar on one worker; the LoRA run wrote its adapter."""
    vocab = json.loads((repo / "work" / "base-model" / "config.json").read_text())["vocab_size"]
    info = _finished(repo, "hf-causal-lm", 12)
    # A fresh base predicts about uniformly (loss ~ ln(vocab)); the grammar is quickly learnt.
    assert info["last_metrics"]["loss"] < math.log(vocab) - 1.0, info["last_metrics"]
    checkpoint = repo / "runs" / "hf-causal-lm" / "checkpoints" / "step-000012"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["samples_consumed"]) == (1, 12 * 8), manifest
    assert (repo / "runs" / "hf-lora" / "adapter" / "adapter_config.json").is_file()


# Checked after a README's blocks ran: what its text says the commands produce, beyond their exit status.
OUTCOMES: dict[str, Callable[[Path], None]] = {
    "examples/plain_module": _plain_module_outcomes,
    "examples/hf_causal_lm": _hf_causal_lm_outcomes,
}


def _plan(readme: Path) -> list[Step]:
    return [step for page in docs_pages() for step in steps(page)] if readme == DOCS else steps(readme)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("readme", [*readmes(), DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shell_block_runs_in_order_or_says_why_not(readme: Path, user):
    repo, ray_temp, env, state = user
    plan = _plan(readme)
    session = ShellSession(readme, repo, state, env, substitutions(readme, ray_temp), block_timeout_s=420)
    try:
        for step in plan:
            assert step.block is not None
            if step.not_run_because is not None:
                assert len(step.not_run_because) > 10, f"{readme}:{step.line}: say why it is not run"
                continue
            if step.block.kind == "file":
                session.write_file(step.block)
            else:
                session.run(step.block)
    finally:
        session.stop()
    assert not session.unused_substitutions(), (
        f"{readme.name} no longer has what these stand for: {session.unused_substitutions()}"
    )
    outcomes = OUTCOMES.get(readme.parent.relative_to(REPO).as_posix())
    if outcomes is not None:
        outcomes(repo)
    shell_blocks = [s for s in plan if s.block and s.block.kind == "shell"]
    assert shell_blocks, f"{readme} has no shell block"
    marked = [(s.line, s.not_run_because) for s in plan if s.not_run_because]
    print(
        f"\n{readme.relative_to(REPO)}: seconds per block run (by line) {session.seconds}; not run: {marked}"
    )
