"""The manual builds as a site with `mkdocs build --strict`: a broken link or anchor, or a page under docs/
that mkdocs.yml's nav leaves out, fails the build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from readme_blocks import REPO

MKDOCS = Path(sys.executable).parent / "mkdocs"


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_manual_builds_strict_into_a_site(tmp_path):
    built = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_a_broken_link_or_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [here](#no-such-anchor)\n")
    (docs / "orphan.md").write_text("# Not in the nav\n")
    config = REPO / "mkdocs.yml"
    text = config.read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    nav = text.index("\nnav:")
    (tmp_path / "mkdocs.yml").write_text(text[:nav] + "\nnav:\n  - Home: index.md\n")
    built = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    out = built.stdout + built.stderr
    assert built.returncode != 0
    assert "missing.md" in out and "no-such-anchor" in out and "orphan.md" in out, out
