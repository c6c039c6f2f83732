"""A peft adapter folder merged into its base model (peft's merge_and_unload), checked, then published.

What LLaMA-Factory's `llamafactory-cli export` writes for a LoRA adapter: the merged model in its base's
dtype, as safetensors shards with an index, with the tokenizer. Before the folder is published it is
loaded back and its logits compared with base + adapter's (the unmerged PeftModel's, in float32), within
the dtype's derived tolerance (tools/export_check.py), as every export is.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from elastictrain.tools import export_check as check
from elastictrain.tools.export import RECORD, ExportResult, check_out_folder, publish
from elastictrain.tools.export_shards import parse_size
from elastictrain.tools.tokenizer_files import copy_tokenizer


def merge_adapter_folder(
    base: str,
    adapter: str,
    out: Path,
    max_shard_size: str = "5GB",
    progress: Callable[[str], None] = lambda line: None,
) -> ExportResult:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    check_out_folder(out)
    dtype = _base_dtype(AutoConfig.from_pretrained(base, local_files_only=True))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    wrapped = PeftModel.from_pretrained(model, adapter, is_trainable=False).eval()
    ids = check.sample_ids(int(model.config.vocab_size))
    unmerged = check.logits(wrapped, ids)
    merged = wrapped.merge_and_unload().eval()
    check.round_parameters(merged, dtype)
    reference = check.Reference(ids, unmerged, check.logits(merged, ids))
    staging = out.with_name(f".{out.name}.export-partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        progress(f"merging {adapter} into {base} ({str(dtype).removeprefix('torch.')})")
        merged.to(dtype).save_pretrained(staging, max_shard_size=parse_size(max_shard_size))
        tokenizer_source = adapter if _has_tokenizer(adapter) else base
        _save_tokenizer(tokenizer_source, staging)
        loaded, info = AutoModelForCausalLM.from_pretrained(
            str(staging), dtype=dtype, local_files_only=True, output_loading_info=True
        )
        check.loaded_cleanly(info, "the merged model")
        checked = check.compare(reference, check.logits(loaded.float().eval(), ids), dtype)
        record = {
            "base": base,
            "adapter": adapter,
            "kind": "merged",
            "dtype": str(dtype).removeprefix("torch."),
        }
        (staging / RECORD).write_text(json.dumps(record | {"check": asdict(checked)}, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    names = sorted(p.name for p in staging.iterdir())
    publish(staging, out)
    return ExportResult(out, "merged", record["dtype"], names, checked, [])


def _base_dtype(config: object) -> torch.dtype:
    """The dtype the base was saved in (float32 where its config names none), as LLaMA-Factory exports."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return getattr(torch, str(value), torch.float32) if value else torch.float32


def _has_tokenizer(folder: str) -> bool:
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def _save_tokenizer(source: str, staging: Path) -> None:
    """`source`'s tokenizer files, loading from `staging` as the class `source` loads as, checked."""
    copy_tokenizer(source, staging)
    check.same_tokenizer(source, staging)
