"""Every shell block of the READMEs and of the manual under docs/ runs, in order, in a fresh copy of the
repository, as a user types it.

Blocks are found by Sybil (tests/readme_blocks.py). A block the page marks "Not run by the README
test" is only checked for its reason. The rest run in one shell per README; README.md and every page of
docs/ (in the order of the site's navigation) run in one shell, the README first, as a new user reads
them, so that a run one page makes serves the pages after it (exported variables and the current
folder carry over from block to block), each bounded in time; a failure names the page and line. The
manual's first run (getting-started.md) is the command `make run` runs: it finds the README's run
finished and continues it, instead of a second cold start of the same training. The commands are the
pages'; the substitutions below only fill in what a user would choose (free ports, a folder of their
own) or shorten a run (fewer steps), and each must still match its page, so none goes stale silently.
What a page says its commands leave behind is checked after its shell ends (OUTCOMES).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers import TEST_MODULE_ROOTS
from readme_blocks import (
    REPO,
    Block,
    ShellSession,
    Step,
    Substitution,
    docs_pages,
    free_ports,
    readmes,
    steps,
)

from elastictrain.rundir.run_dir import RunDir

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


README = REPO / "README.md"  # with every page of docs/ after it, in the nav's order, in one shell


def substitutions(readme: Path, ray_temp: Path) -> list[Substitution]:
    if readme == README:
        return readme_substitutions() + docs_substitutions(ray_temp)
    return []


def docs_substitutions(ray_temp: Path) -> list[Substitution]:
    *ports, dashboard = free_ports(9, for_later=True)
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
        Substitution("127.0.0.1:52365", f"127.0.0.1:{ports[4]}", "the agent's port chosen above"),
    ]


def readme_substitutions() -> list[Substitution]:
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
            "training.max_steps=60 scaling.max_workers=3",
            "training.max_steps=2",
            "no steps to add, so no second cold start (extending is tested in test_resume.py); the "
            "same config, so the manual's first run (the same command as `make run`) continues this "
            "one; a resume with more workers is the elastic-runs page's, run later in this shell",
        ),
    ]


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


@dataclass
class Ran:
    """What a README's shell left: the copy it ran in, its Ray temp dir, each block's output."""

    repo: Path
    ray_temp: Path
    outputs: list[tuple[Block, str]] = field(default_factory=list)

    def outputs_of(self, page: str, command: str) -> list[str]:
        """The outputs of the blocks on `page` (relative to the repo) that run `command`, in order."""
        return [out for b, out in self.outputs if b.page == REPO / page and command in b.source]


def _finished(repo: Path, name: str, last_step: int) -> dict[str, Any]:
    info = json.loads((repo / "runs" / name / "run.json").read_text())
    assert (info["status"], info["last_step"]) == ("FINISHED", last_step), (name, info)
    return info


def _plain_module_outcomes(ran: Ran) -> None:
    """What its README promises: three runs of 20 steps, FINISHED; the model learned."""
    repo = ran.repo
    for name in ("plain-module", "on-ray"):
        _finished(repo, name, 20)
    info = _finished(repo, "from-python", 20)  # elastictrain.fit with the objects themselves
    # The targets have variance ~0.5; a model that learned nothing stays there.
    assert info["last_metrics"]["loss"] < 0.2, info["last_metrics"]
    assert (repo / "runs" / "from-python" / "checkpoints" / "step-000020" / "manifest.json").is_file()


def _hf_causal_lm_outcomes(ran: Ran) -> None:
    """The fine-tune learned the example's grammar on one worker; the LoRA run wrote its adapter."""
    repo = ran.repo
    vocab = json.loads((repo / "work" / "base-model" / "config.json").read_text())["vocab_size"]
    info = _finished(repo, "hf-causal-lm", 12)
    # A fresh base predicts about uniformly (loss ~ ln(vocab)); the grammar is quickly learnt.
    assert info["last_metrics"]["loss"] < math.log(vocab) - 1.0, info["last_metrics"]
    checkpoint = repo / "runs" / "hf-causal-lm" / "checkpoints" / "step-000012"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["samples_consumed"]) == (1, 12 * 8), manifest
    assert (repo / "runs" / "hf-lora" / "adapter" / "adapter_config.json").is_file()


def _job_submit_outcomes(ran: Ran) -> None:
    """docs/guides/ray-job-submit.md: the job streams its progress and succeeds, leaving the run in
    run.dir as a run from a shell does; its upload leaves what .gitignore lists behind; the same job
    submitted again continues that run (here: finds it finished); the run too big for the cluster
    fails its job naming the setting."""
    submit, again, too_big = ran.outputs_of("docs/guides/ray-job-submit.md", "ray job submit")
    for step in (1, 2):  # one plain line per step reaches the submitter while the job runs
        assert f"step {step}/2 loss" in submit, submit[-4000:]
    assert "connected to Ray at 127.0.0.1:" in submit and "finished at step 2" in submit, submit[-4000:]
    run = RunDir.open(ran.repo / "runs" / "tiny")
    info = run.read_info()
    assert (info.status, info.last_step) == ("FINISHED", 2) and info.mlflow_run_id, info
    assert (run.path / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert [h["world_size"] for h in info.world_size_history] == [2]
    events = [e["event"] for e in run.read_events()]
    # One start: the second job continued the run. Its plots are drawn from its finished events.
    assert events.count("start") == 1 and events[-2:] == ["finish", "plots"], events
    assert "already holds this run: continuing it" in again and "already finished at step 2" in again

    assert "failure.wait_for_capacity_s" in too_big and "scaling.min_workers=3" in too_big, too_big[-3000:]
    failed = RunDir.open(ran.repo / "runs" / "too-big").read_info()
    assert failed.status == "FAILED" and "wait_for_capacity_s" in (failed.message or ""), failed

    # The upload is the copy's own files: runs/ (gitignored, checkpoints by now) stays behind.
    unpacked = ran.ray_temp.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*")
    packages = [p for p in unpacked if p.is_dir()]
    assert packages, "the working dir package was not found"
    for pkg in packages:
        assert (pkg / "conf" / "tiny-cpu.yaml").is_file() and (pkg / "src" / "elastictrain").is_dir()
        assert not (pkg / "runs").exists(), sorted(p.name for p in pkg.iterdir())
        size = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())
        assert size < 20_000_000, f"working dir upload of {size} bytes: something large is not ignored"


# Checked after a README's blocks ran: what its text says the commands produce, beyond their exit status.
OUTCOMES: dict[str, Callable[[Ran], None]] = {
    "README.md+docs": _job_submit_outcomes,
    "examples/plain_module/README.md": _plain_module_outcomes,
    "examples/hf_causal_lm/README.md": _hf_causal_lm_outcomes,
}


def _plan(readme: Path) -> list[Step]:
    if readme == README:
        return [*steps(README), *(step for page in docs_pages() for step in steps(page))]
    return steps(readme)


def _shown(readme: Path) -> str:
    return "README.md+docs" if readme == README else readme.relative_to(REPO).as_posix()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("readme", readmes(), ids=_shown)
def test_every_shell_block_runs_in_order_or_says_why_not(readme: Path, user):
    repo, ray_temp, env, state = user
    plan = _plan(readme)
    session = ShellSession(readme, repo, state, env, substitutions(readme, ray_temp), block_timeout_s=420)
    ran = Ran(repo, ray_temp)
    try:
        for step in plan:
            assert step.block is not None
            if step.not_run_because is not None:
                page = step.block.page or readme
                assert len(step.not_run_because) > 10, f"{page}:{step.line}: say why it is not run"
                continue
            if step.block.kind == "file":
                session.write_file(step.block)
            else:
                ran.outputs.append((step.block, session.run(step.block)))
    finally:
        session.stop()
    assert not session.unused_substitutions(), (
        f"{readme.name} no longer has what these stand for: {session.unused_substitutions()}"
    )
    outcomes = OUTCOMES.get(_shown(readme))
    if outcomes is not None:
        outcomes(ran)
    shell_blocks = [s for s in plan if s.block and s.block.kind == "shell"]
    assert shell_blocks, f"{readme} has no shell block"
    marked = [(s.line, s.not_run_because) for s in plan if s.not_run_because]
    print(
        f"\n{readme.relative_to(REPO)}: seconds per block run (by line) {session.seconds}; not run: {marked}"
    )
