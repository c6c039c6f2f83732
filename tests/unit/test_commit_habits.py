"""The history keeps its habits from the commit that set them on: a subject of at most 72 characters and
a body that says why (and what was measured). Older commits are left as they are."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SINCE = "bef4295"  # the last commit before the habits were set (issue 59)
SUBJECT_MAX = 72


def _log() -> list[tuple[str, str, str]]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to read")
    known = subprocess.run(["git", "cat-file", "-e", f"{SINCE}^{{commit}}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"a shallow clone without {SINCE}: the history since then cannot be read")
    out = subprocess.run(
        ["git", "log", "--no-merges", "--format=%h%x1f%s%x1f%b%x1e", f"{SINCE}..HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [tuple(entry.strip("\n").split("\x1f")) for entry in out.split("\x1e") if entry.strip()]  # type: ignore[misc]


def test_every_commit_since_the_habits_were_set_has_a_short_subject_and_a_body() -> None:
    bad = []
    for sha, subject, body in _log():
        if len(subject) > SUBJECT_MAX:
            bad.append(f"{sha}: subject of {len(subject)} characters")
        if len(body.split()) < 5:
            bad.append(f"{sha}: no body saying why")
    assert not bad, "; ".join(bad)
