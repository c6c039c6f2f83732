"""docs/reference/llamafactory-keys.md from the mapping table (keys.py), so the page cannot drift from it."""

from __future__ import annotations

import json
from typing import Any

from elastictrain.config.llamafactory.export_file import NO_EFFECT as MERGE_NO_EFFECT
from elastictrain.config.llamafactory.export_file import REFUSED as MERGE_REFUSED
from elastictrain.config.llamafactory.keys import KEYS, MAPPED, NO_EFFECT, REFUSED

HEADER = """\
# LLaMA-Factory's keys

Generated from `src/elastictrain/config/llamafactory/keys.py` by `make docs-reference`; do not edit.

`elastictrain train -c FILE.yaml` reads a LLaMA-Factory training file with every key below, and each
key it does not give at LLaMA-Factory's default (its own, else transformers' `TrainingArguments`'), so
the same file means the same training in both
([Coming from LLaMA-Factory](../guides/coming-from-llamafactory.md)). A key is *mapped* (it becomes the
elastictrain keys named), has *no effect* here (said at start, with the reason), or is *refused* when
given a value other than its default (the error names the key and what to use instead). A key not
listed is refused by name. `--print-config` prints the elastictrain config a file becomes.
"""


def _value(value: Any) -> str:
    return "`null`" if value is None else f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    lines = [HEADER]
    for kind, title, columns in (
        (MAPPED, "Mapped", "| key | LLaMA-Factory's default | becomes | note |\n|---|---|---|---|"),
        (NO_EFFECT, "No effect here", "| key | LLaMA-Factory's default | why |\n|---|---|---|"),
        (
            REFUSED,
            "Refused (unless at the default)",
            "| key | LLaMA-Factory's default | instead |\n|---|---|---|",
        ),
    ):
        lines += [f"## {title}\n", columns]
        for key in sorted((k for k in KEYS if k.kind == kind), key=lambda k: k.name):
            if kind == MAPPED:
                becomes = ", ".join(
                    f"`{p.strip()}`" if p.strip()[0] != "(" else p.strip() for p in key.becomes.split(",")
                )
                lines.append(f"| `{key.name}` | {_value(key.default)} | {becomes} | {_cell(key.note)} |")
            else:
                lines.append(f"| `{key.name}` | {_value(key.default)} | {_cell(key.note)} |")
        lines.append("")
    lines += [
        "## Merge files (`elastictrain export -c FILE.yaml`)\n",
        "Read: `model_name_or_path`, `adapter_name_or_path`, `export_dir`, `export_size` (GB per shard), "
        "`model_revision`, `cache_dir`.\n",
        "| key | default | no effect / refused |\n|---|---|---|",
    ]
    for name, (default, why) in sorted(MERGE_NO_EFFECT.items()):
        lines.append(f"| `{name}` | {_value(default)} | no effect: {_cell(why)} |")
    for name, (default, why) in sorted(MERGE_REFUSED.items()):
        lines.append(f"| `{name}` | {_value(default)} | refused: {_cell(why)} |")
    return "\n".join(lines) + "\n"
