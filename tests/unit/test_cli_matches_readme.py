"""`--help` and the manual agree, both ways, for every command (also those added later).

Every `elastictrain COMMAND --option` the READMEs and the pages under docs/ show (in code blocks and
inline code) exists with that spelling and is in `elastictrain COMMAND --help`; every command of
`elastictrain --help` is shown on a written page (the generated CLI reference aside) and has its
section in docs/reference/cli.md; every `make TARGET` they show is a target of the Makefile.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from markdown_it import MarkdownIt
from readme_blocks import REPO, docs_pages, manual
from typer.testing import CliRunner

from elastictrain.cli import app

CLI_REFERENCE = REPO / "docs" / "reference" / "cli.md"
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}


@dataclass(frozen=True)
class Mention:
    """`elastictrain ARGS...` (or `make ARGS...`) as a README shows it, and where."""

    where: str  # README:LINE
    program: str
    args: tuple[str, ...]


def _code_snippets(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every fenced block and inline code span, found by markdown-it."""
    text = path.read_text()
    lines = text.split("\n")
    for token in MarkdownIt("commonmark").parse(text):
        if token.type == "fence" and token.map:
            yield token.map[0] + 2, token.content
        elif token.type == "inline" and token.map and token.children:
            for child in token.children:
                if child.type == "code_inline":
                    start = token.map[0]
                    found = next(
                        (i for i in range(start, token.map[1]) if child.content in lines[i]),
                        start,
                    )
                    yield found + 1, child.content


def _segments(snippet: str) -> Iterator[tuple[int, list[str]]]:
    """Each simple command of a snippet as words, with its line offset (comments dropped)."""
    logical: list[tuple[int, str]] = []
    continued = False
    for offset, line in enumerate(snippet.split("\n")):
        if continued:
            logical[-1] = (logical[-1][0], logical[-1][1] + " " + line.rstrip("\\"))
        else:
            logical.append((offset, line.rstrip("\\")))
        continued = line.endswith("\\")
    for offset, line in logical:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            words = list(lexer)
        except ValueError:  # prose in backticks with an unmatched quote: not a command
            continue
        current: list[str] = []
        for word in words:
            if word in SEPARATORS:
                if current:
                    yield offset, current
                current = []
            else:
                current.append(word)
        if current:
            yield offset, current


def mentions(paths: list[Path], program: str) -> list[Mention]:
    """`program ...` where it is the command run: first, after `--`, `-m`, `$(` or VAR=value."""
    found: list[Mention] = []
    for path in paths:
        for line, snippet in _code_snippets(path):
            for offset, words in _segments(snippet):
                for i, word in enumerate(words):
                    before = words[i - 1] if i else None
                    runs_it = (
                        before is None or before in ("--", "-m", "exec") or re.fullmatch(r"\w+=\S*", before)
                    )
                    if Path(word).name == program and runs_it and i + 1 <= len(words):
                        where = (
                            f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line + offset}"
                        )
                        found.append(Mention(where, program, tuple(words[i + 1 :])))
                        break
    return found


def _cli():  # noqa: ANN202 - typer's click group (typer may carry its own click)
    group = typer.main.get_command(app)
    assert hasattr(group, "commands"), group
    return group


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], terminal_width=300, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return result.output


def _options(words: tuple[str, ...]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)]


def test_every_command_and_option_the_manual_shows_exists_with_that_spelling_in_help():
    cli = _cli()
    shown = mentions(manual(), "elastictrain")
    assert len(shown) > 20, shown  # the extraction works: the READMEs show many commands
    problems = []
    for m in shown:
        if not m.args or m.args[0].startswith("-"):
            continue
        name, rest = m.args[0], m.args[1:]
        command = cli.commands.get(name)
        if command is None:
            problems.append(
                f"{m.where}: `elastictrain {name}`: no such command; there are {sorted(cli.commands)}"
            )
            continue
        known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
        help_text = _help(name)
        for option in _options(rest):
            if option not in known:
                problems.append(
                    f"{m.where}: `elastictrain {name} {option}`: no such option; it has {sorted(known)}"
                )
            elif option not in help_text:
                problems.append(f"{m.where}: `{option}` is an option of `{name}` but not in its --help")
    assert not problems, "\n".join(problems)


def test_every_command_of_help_is_shown_in_the_manual_and_has_its_reference_section():
    top_help = _help()
    written = [page for page in manual() if page != CLI_REFERENCE]
    shown = {m.args[0] for m in mentions(written, "elastictrain") if m.args}
    commands = [name for name, c in _cli().commands.items() if not c.hidden]
    assert all(name in top_help for name in commands), top_help
    missing = [name for name in commands if name not in shown]
    assert not missing, (
        f"commands of `elastictrain --help` that no README or page of docs/ shows as `elastictrain NAME`: "
        f"{missing}"
    )
    reference = CLI_REFERENCE.read_text()
    assert CLI_REFERENCE in docs_pages()
    unlisted = [name for name in commands if f"\n## {name}\n" not in reference]
    assert not unlisted, f"{CLI_REFERENCE}: no section for {unlisted}; run make docs-reference"


def test_every_make_target_the_manual_shows_is_in_the_makefile():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):(?!=)", makefile, re.MULTILINE))
    shown = mentions(manual(), "make")
    assert shown, "the READMEs show no make command"
    problems = [
        f"{m.where}: `make {word}`: no such target; the Makefile has {sorted(targets)}"
        for m in shown
        for word in m.args
        if not word.startswith("-") and "=" not in word and word not in targets
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("elastictrain train -c x.yaml --fresh", [("train", "-c", "x.yaml", "--fresh")]),
        ("ray job submit --address A -- \\\n  elastictrain resume r --local", [("resume", "r", "--local")]),
        ("kubectl -n elastictrain get pods", []),
        ("PYTHONPATH=examples elastictrain status r  # elastictrain nope", [("status", "r")]),
        ("python -m elastictrain verify r && elastictrain runs runs/", [("verify", "r"), ("runs", "runs/")]),
    ],
)
def test_mentions_are_read_as_a_shell_reads_the_command(tmp_path, snippet, expected):
    readme = tmp_path / "README.md"
    readme.write_text(f"Run `elastictrain runs x` or:\n\n```bash\n{snippet}\n```\n")
    found = [m.args for m in mentions([readme], "elastictrain")]
    assert found == [("runs", "x"), *expected]
    lines = [m.where.rsplit(":", 1)[1] for m in mentions([readme], "elastictrain")]
    assert lines[:2] == ["1", "4"][: len(lines)]  # the span's line; the block's first line
