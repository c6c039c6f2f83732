"""Checks of `data.source: sft` that need no tokenizer and no record: the files, the dataset_info.json
entries (hub and ranking ones refused with their reason), the options' values.

The records themselves are checked on the driver before any worker starts (driver/preflight.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastictrain.data.sft.dataset_info import sources_and_problems
from elastictrain.data.sft.tool_text import TOOL_FORMATS

ON_BAD_RECORD = ("error", "skip")


def tool_format_problem(value: object, where: str = "data") -> str | None:
    if value is None or value in TOOL_FORMATS:
        return None
    return (
        f"{where}.tool_format: got {value!r}; expected json (tools as a JSON list in the system turn, calls "
        "as JSON in the answer), qwen (LLaMA-Factory's qwen format: <tools>, <tool_call>, <tool_response>) "
        "or null (the chat template renders tool calls and tools)"
    )


def sft_problems(config: Any) -> list[str]:
    d, p = config.data, []
    e = getattr(config.eval, "data", None)  # its own value only: one it takes from data is named there
    if e is not None and e.source == "sft" and (e.tool_format != d.tool_format or d.source != "sft"):
        p.extend(x for x in [tool_format_problem(e.tool_format, "eval.data")] if x)
    if d.source != "sft":
        return p
    if d.dataset is not None and not isinstance(d.dataset, str | list):
        p.append(f"data.dataset: got {d.dataset!r}; expected names of dataset_info.json: 'a,b' or a list")
        return p
    if getattr(config.training, "objective", "lm") == "lm":
        p.extend(sources_and_problems(d)[1])
    else:  # ranking: true and kto_tag entries, refused above for supervised fine-tuning
        from elastictrain.data.preference.sources import preference_sources

        p.extend(preference_sources(d)[1])
    if d.on_bad_record not in ON_BAD_RECORD:
        p.append(
            f"data.on_bad_record: got {d.on_bad_record!r}; expected error (name bad records and refuse to "
            "start) or skip (drop them and say how many)"
        )
    p.extend(x for x in [tool_format_problem(d.tool_format)] if x)
    if d.max_samples is not None and d.max_samples < 1:
        p.append(f"data.max_samples: got {d.max_samples}; expected >= 1 (records per dataset) or null (all)")
    folder = d.tokenizer or config.model.pretrained
    if not folder:
        p.append(
            "data.tokenizer: missing; expected a local tokenizer folder when data.source is 'sft' (or "
            "model.pretrained, whose folder holds its tokenizer)"
        )
    elif d.tokenizer and not Path(d.tokenizer).is_dir():
        p.append(f"data.tokenizer: got {d.tokenizer!r}; expected an existing folder (save_pretrained)")
    if d.template and not Path(d.template).is_file():
        p.append(f"data.template: got {d.template!r}; expected a Jinja chat template file")
    return p
