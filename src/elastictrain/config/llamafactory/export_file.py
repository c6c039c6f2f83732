"""A LLaMA-Factory merge/export YAML (`examples/merge_lora/*.yaml`) as what `elastictrain export` does.

- `model_name_or_path` an elastictrain run folder (a full fine-tune's output_dir): that run is exported;
- with `adapter_name_or_path` an elastictrain run folder: its checkpoint is exported with the adapter
  merged in (the run's own record of its base must be model_name_or_path);
- with `adapter_name_or_path` a peft adapter folder: the base (a folder or a cached hub id) with the
  adapter merged in (tools/merge_adapter.py).
`export_dir` is the output, `export_size` the largest shard in GB. Each is checked against base + adapter
before it is published, as every export is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.config.llamafactory.reading import Reading, comma_list

# key -> (default, why it has no effect) ; refused keys -> (default, what instead)
NO_EFFECT = {
    "template": (None, "the export carries the tokenizer's own chat template"),
    "trust_remote_code": (False, "models load with transformers' own classes"),
    "export_device": ("cpu", "the merge runs on the CPU of this machine"),
    "finetuning_type": ("lora", "read from the adapter"),
    "stage": ("sft", "an export has no stage"),
    "infer_dtype": ("auto", "the merged model is written in its base's dtype (a run's: its precision)"),
}
REFUSED = {
    "export_legacy_format": (False, "safetensors shards only (transformers, peft and vLLM load them)"),
    "export_quantization_bit": (None, "quantized exports are not supported"),
    "export_quantization_dataset": (None, "quantized exports are not supported"),
    "export_hub_model_id": (None, "nothing is uploaded; push the folder with `hf upload`"),
    "quantization_bit": (None, "merge into the unquantized model"),
}
READ = (
    "model_name_or_path",
    "adapter_name_or_path",
    "export_dir",
    "export_size",
    "model_revision",
    "cache_dir",
)


@dataclass
class MergeRequest:
    base: str | None  # a model folder (resolved from a hub id where one was given)
    run: str | None  # an elastictrain run folder to export (merged where it is a LoRA run)
    adapter: str | None  # a peft adapter folder to merge into `base`
    out: str
    max_shard_size: str
    notices: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def is_run_folder(path: str | None) -> bool:
    return bool(path) and (Path(str(path)) / "run.json").is_file()


def read_merge_file(raw: dict[str, Any], cwd: Path | None = None) -> MergeRequest:
    r = Reading(raw, cwd or Path.cwd())
    problems, notices = [], []
    for name, value in raw.items():
        if name in REFUSED and value != REFUSED[name][0]:
            problems.append(f"{name}: got {value!r}; not supported: {REFUSED[name][1]}")
        elif name in NO_EFFECT and value != NO_EFFECT[name][0]:
            notices.append(f"{name}: no effect here ({NO_EFFECT[name][1]})")
        elif name not in (*READ, *NO_EFFECT, *REFUSED):
            problems.append(f"{name}: not a key of a LLaMA-Factory merge file that elastictrain reads")
    out = raw.get("export_dir")
    if not out:
        problems.append("export_dir: missing; expected the folder to write the merged model into")
    size = raw.get("export_size", 5)
    if not isinstance(size, int | float) or size <= 0:
        problems.append(f"export_size: got {size!r}; expected the largest shard in GB, a number > 0")
    base, run, adapter = _sources(r, raw, problems, notices)
    return MergeRequest(base, run, adapter, r.path(str(out or ".")), f"{size}GB", notices, problems)


def _sources(
    r: Reading, raw: dict[str, Any], problems: list[str], notices: list[str]
) -> tuple[str | None, str | None, str | None]:
    from elastictrain.config.hub_cache import HubModelMissing, resolve_model

    ref = raw.get("model_name_or_path")
    if not ref:
        problems.append("model_name_or_path: missing; expected the base model (a folder or a cached hub id)")
        return None, None, None
    adapters = comma_list(raw.get("adapter_name_or_path"))
    if len(adapters) > 1:
        problems.append(f"adapter_name_or_path: got {len(adapters)} adapters; expected one")
        return None, None, None
    if not adapters and is_run_folder(r.path(str(ref))):
        return None, r.path(str(ref)), None  # a full fine-tune's run folder, exported as it is
    try:
        found = resolve_model(
            str(ref),
            "model_name_or_path",
            str(raw.get("model_revision") or "main"),
            cache=raw.get("cache_dir"),
        )
    except HubModelMissing as e:
        problems.append(str(e))
        return None, None, None
    if found is not None:
        notices.append(found.line("model_name_or_path"))
    base = found.path if found else r.path(str(ref))
    if not adapters:
        problems.append(
            "adapter_name_or_path: missing, and model_name_or_path is not an elastictrain run folder; "
            "expected a LoRA run folder or a peft adapter folder to merge"
        )
        return base, None, None
    adapter = r.path(adapters[0])
    try:  # an adapter named by hub id, read from the cache as the base is
        cached = resolve_model(adapters[0], "adapter_name_or_path", cache=raw.get("cache_dir"))
    except HubModelMissing as e:
        problems.append(str(e))
        return base, None, None
    adapter = cached.path if cached else adapter
    if is_run_folder(adapter):
        return base, adapter, None
    if not (Path(adapter) / "adapter_config.json").is_file():
        problems.append(
            f"adapter_name_or_path: got {adapters[0]!r}; expected an elastictrain run folder (run.json) or a "
            "peft adapter folder (adapter_config.json)"
        )
        return base, None, None
    return base, None, adapter
