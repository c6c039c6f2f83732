"""docs/reference/config.md from the schema: every key by dotted path, its type, default and description.

Descriptions are read from the schema's source, so the schema stays the one place they are written: a
key's description is the comment beside it plus the comment lines right above it; a section's is its
class docstring. A key without one is listed by `undescribed()` (a test keeps that list empty).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.config import schema

HEADER = """\
# Configuration reference

Generated from the schema (`src/elastictrain/config/schema.py`) by `make docs-reference`; do not edit.

A config is a YAML file of these sections (`elastictrain train -c FILE`), overridden by `key=value`
arguments with the dotted keys below (`training.max_steps=100`). Unknown keys and values of the wrong
type are errors that name the key, before any worker starts. `elastictrain train -c FILE --print-config`
prints the resolved config. `${...}` in a default refers to another key.
"""


@dataclass(frozen=True)
class Key:
    path: str  # dotted, e.g. training.max_steps
    type: str  # as the schema writes it, e.g. `str | None`
    default: Any
    description: str


@dataclass(frozen=True)
class Section:
    path: str  # dotted, e.g. model.lora
    description: str
    keys: list[Key]


@dataclass(frozen=True)
class _ClassSource:
    docstring: str
    fields: dict[str, tuple[str, str]]  # field name -> (annotation as written, description)


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text, whether the comment is the whole line)."""
    out: dict[int, tuple[str, bool]] = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            whole = not lines[row - 1][:col].strip()
            out[row] = (tok.string.lstrip("#").strip(), whole)
    return out


def _read_source() -> dict[str, _ClassSource]:
    source = Path(schema.__file__).read_text()
    comments = _comments(source)
    classes: dict[str, _ClassSource] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, tuple[str, str]] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            row = stmt.lineno - 1
            while row in comments and comments[row][1]:
                above.insert(0, comments[row][0])
                row -= 1
            beside = [
                comments[r][0]
                for r in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                if r in comments and not comments[r][1]
            ]
            fields[stmt.target.id] = (ast.unparse(stmt.annotation), " ".join([*above, *beside]).strip())
        doc = " ".join((ast.get_docstring(node) or "").split())
        classes[node.name] = _ClassSource(doc, fields)
    return classes


def _is_section(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def sections() -> list[Section]:
    """Every section of the config, depth first, each with its own keys (nested sections apart)."""
    source = _read_source()
    out: list[Section] = []

    def walk(path: str, value: Any) -> None:
        cls = source[type(value).__name__]
        keys: list[Key] = []
        nested: list[tuple[str, Any]] = []
        for f in dataclasses.fields(value):
            child = getattr(value, f.name)
            dotted = f"{path}.{f.name}" if path else f.name
            if _is_section(child):
                nested.append((dotted, child))
                continue
            annotation, description = cls.fields.get(f.name, ("", ""))
            keys.append(Key(dotted, annotation, child, description))
        if path:
            out.append(Section(path, cls.docstring, keys))
        for dotted, child in nested:
            walk(dotted, child)

    walk("", schema.Config())
    return out


def undescribed() -> list[str]:
    """Keys and sections with no description in the schema's source."""
    missing = [s.path for s in sections() if not s.description]
    return missing + [k.path for s in sections() for k in s.keys if not k.description]


def _default(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value)}`" if value else ("`{}`" if isinstance(value, dict) else "`[]`")
    return f"`{value}`"


def _sentence(text: str) -> str:
    """A capital first letter, unless the text starts with a name (`source=hf`, `error:`, `"module:attr"`)."""
    first = text.split(" ", 1)[0]
    return text[:1].upper() + text[1:] if first.replace("'", "").isalpha() and first.islower() else text


def _cell(text: str) -> str:
    """A table cell: `|` escaped outside code spans (inside them mkdocs' tables keep it as it is)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def render() -> str:
    lines = [HEADER]
    for section in sections():
        lines += [f"## {section.path}", "", section.description, ""]
        lines += ["| Key | Type | Default | Description |", "|---|---|---|---|"]
        for key in section.keys:
            lines.append(
                f"| `{key.path}` | {_cell(f'`{key.type}`')} | {_cell(_default(key.default))} | "
                f"{_cell(_sentence(key.description))} |"
            )
        lines.append("")
    return "\n".join(lines)
