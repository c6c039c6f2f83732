"""The generated pages of the manual: docs/reference/config.md (from the schema), cli.md (from the CLI) and
llamafactory-keys.md (from the LLaMA-Factory key table).

python -m elastictrain.cli.reference_docs           # write them (make docs-reference)
python -m elastictrain.cli.reference_docs --check   # exit 1, naming them, if they are stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from elastictrain.cli import reference as cli_reference
from elastictrain.config import reference as config_reference
from elastictrain.config.llamafactory import reference as llamafactory_reference

REGENERATE = "make docs-reference (python -m elastictrain.cli.reference_docs)"
PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_reference.render,
    "reference/cli.md": cli_reference.render,
    "reference/llamafactory-keys.md": llamafactory_reference.render,
}


def default_docs() -> Path:
    """docs/ of the checkout this module runs from (src/elastictrain/tools/ -> the repository root)."""
    return Path(__file__).resolve().parents[3] / "docs"


def generate() -> dict[str, str]:
    """Each generated page's path under docs/ and its content as the generators now produce it."""
    return {name: render() for name, render in PAGES.items()}


def stale(docs: Path) -> list[str]:
    """The generated pages whose committed content differs from what the generators now produce."""
    return [name for name, text in generate().items() if _read(docs / name) != text]


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=default_docs(), help="the manual's folder")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale(args.docs)
        if old:
            print(
                f"stale generated pages in {args.docs}: {', '.join(old)}; run {REGENERATE}", file=sys.stderr
            )
            return 1
        return 0
    for name, text in generate().items():
        path = args.docs / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if _read(path) != text:
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
