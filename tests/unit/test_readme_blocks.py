"""The README runner itself: blocks in order, state carried over, failures named by README line.

(The READMEs' own blocks run in tests/integration/test_readme_commands.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from readme_blocks import ShellSession, Substitution, docs_pages, readmes, steps, with_expected_errors

README = """\
# A tool

```bash
export GREETING=hello          # carried to the next block
mkdir -p work && cd work
```

```python
# tool.py
import sys
print("tool says", sys.argv[1])
```

*Not run by the README test: needs a cluster that is not here.*

```bash
kubectl apply -f nothing.yaml
```

```bash
python tool.py "$GREETING" > said.txt
grep -q "tool says hello" said.txt
sh -c 'echo "error: no such thing" >&2; exit 2'
# error: no such thing
echo PLACEHOLDER
false
```
"""


def _session(tmp_path: Path, readme: Path) -> ShellSession:
    cwd = tmp_path / "copy"
    cwd.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    subs = [
        Substitution("PLACEHOLDER", "filled-in", "what a user types"),
        Substitution("absent", "x", "stale"),
    ]
    return ShellSession(readme, cwd, tmp_path / "state", env, subs, block_timeout_s=60)


def test_blocks_run_in_order_with_state_carried_and_a_failure_names_its_readme_line(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    plan = steps(readme)
    assert [(s.block.kind if s.block else None, s.not_run_because) for s in plan] == [
        ("shell", None),
        ("file", None),
        ("shell", "needs a cluster that is not here."),
        ("shell", None),
    ]
    session = _session(tmp_path, readme)
    try:
        session.run(plan[0].block)
        session.write_file(plan[1].block)
        assert (tmp_path / "copy" / "work" / "tool.py").read_text().startswith("# tool.py\n")
        with pytest.raises(AssertionError) as failed:
            session.run(plan[3].block)
    finally:
        session.stop()
    message = str(failed.value)
    # `false` is the README's line 26; the expected error and the filled-in placeholder passed.
    assert message.startswith(f"{readme}:26: `false` exited 1"), message
    assert "filled-in" in message and (tmp_path / "copy" / "work" / "said.txt").is_file()
    assert session.unused_substitutions() == ["'absent' (stale)"]


def test_a_command_that_should_fail_but_succeeds_is_a_failure(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x\n\n```bash\ntrue\n# error: something\n```\n")
    session = _session(tmp_path, readme)
    with pytest.raises(AssertionError, match=r"README.md:4: `expect_error 'error: something' true` exited 1"):
        session.run(steps(readme)[0].block)


def test_an_expected_error_after_a_command_continued_over_lines_checks_the_whole_command(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x\n\n```bash\nsh -c \\\n  'echo error: said; exit 3'\n# error: said\n```\n")
    session = _session(tmp_path, readme)
    try:
        assert "error: said" in session.run(steps(readme)[0].block)
    finally:
        session.stop()
    assert with_expected_errors("a \\\n  b\n# error: E").split("\n")[0] == "expect_error 'error: E' a \\"


def test_a_mark_must_stand_just_before_a_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("*Not run by the README test: because.*\n\nSome prose.\n\n```bash\ntrue\n```\n")
    with pytest.raises(ValueError, match="README.md:1: a 'Not run' mark must stand just before a block"):
        steps(readme)


def test_every_readme_and_page_of_the_manual_parses_and_every_mark_says_why():
    found = {path: steps(path) for path in [*readmes(), *docs_pages()]}
    assert len(found) >= 4 + 20, found  # README.md, k8s/README.md, the examples' READMEs, docs/
    for path in readmes():
        assert any(s.block and s.block.kind == "shell" for s in found[path]), f"{path}: no shell block"
    for path, plan in found.items():
        for step in plan:
            assert step.not_run_because is None or len(step.not_run_because) > 10, (path, step)
