"""docs/reference/cli.md from the CLI itself: every command, its usage, arguments and options.

The CLI is walked as the click command typer builds from `elastictrain.cli.app`, so a command or an
option added there shows up here at the next `make docs-reference` (and a test fails until then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HEADER = """\
# Command-line reference

Generated from the CLI (`elastictrain.cli`) by `make docs-reference`; do not edit. Each command's
`--help` prints the same. `OVERRIDES` are `key=value` settings with the dotted keys of the
[configuration reference](config.md).
"""


@dataclass(frozen=True)
class Param:
    names: str  # `--out`, or `-c`, `--config`, or an argument's name
    kind: str  # "argument" or "option"
    type: str
    default: str
    required: bool
    help: str


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    help: str
    params: list[Param]


def _cli() -> Any:  # typer's click group (typer may carry its own click)
    import typer

    from elastictrain.cli import app

    return typer.main.get_command(app)


def _type(param: Any, ctx: Any) -> str:
    if getattr(param, "is_flag", False):
        return "flag"
    try:
        shown = param.display_type(ctx)
    except (AttributeError, TypeError):
        shown = getattr(getattr(param, "type", None), "name", "")
    return str(shown).strip("<>").lower().replace("list[", "list of ").rstrip("]")


def _default(param: Any) -> str:
    value = param.default
    if getattr(param, "is_flag", False):
        return "off" if not value else "on"
    if value is None or callable(value) or (isinstance(value, (list, tuple)) and not value):
        return ""
    return f"`{value}`"


def commands() -> list[Command]:
    """Every command that `elastictrain --help` lists, in its order."""
    group = _cli()
    ctx = group.make_context("elastictrain", [], resilient_parsing=True)
    out: list[Command] = []
    for name, command in group.commands.items():
        if command.hidden:
            continue
        sub = command.make_context(name, [], parent=ctx, resilient_parsing=True)
        usage = command.get_usage(sub).replace("Usage: ", "", 1).strip()
        params = []
        for p in command.params:
            if getattr(p, "hidden", False):
                continue
            argument = p.param_type_name == "argument"
            names = (
                (p.metavar or p.name.upper())
                if argument
                else ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            )
            if argument:
                names = f"`{names}{'...' if p.nargs == -1 else ''}`"
            params.append(
                Param(names, p.param_type_name, _type(p, sub), _default(p), p.required, p.help or "")
            )
        out.append(Command(name, usage, " ".join((command.help or "").split()), params))
    return out


def _cell(text: str) -> str:
    """A table cell: `|` escaped outside code spans (inside them mkdocs' tables keep it as it is)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def render() -> str:
    group = _cli()
    found = commands()
    lines = [HEADER, f"`elastictrain`: {group.help}", "", "| Command | What it does |", "|---|---|"]
    lines += [f"| [`{c.name}`](#{c.name}) | {_cell(c.help.split('. ')[0].rstrip('.'))} |" for c in found]
    lines.append("")
    for c in found:
        lines += [f"## {c.name}", "", c.help, "", "```", c.usage, "```", ""]
        if c.params:
            lines += ["| Argument or option | Type | Default | Description |", "|---|---|---|---|"]
            for p in c.params:
                needed = " (required)" if p.required else ""
                lines.append(f"| {p.names}{needed} | {p.type} | {_cell(p.default)} | {_cell(p.help)} |")
            lines.append("")
    return "\n".join(lines)
