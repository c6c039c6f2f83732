"""Export of a LoRA run's adapter in peft's layout, from a committed checkpoint (offline, on the driver).

Two callers: the run's end (`export_adapter`, from the run's config, into model.lora.export_dir) and
`elastictrain export` (`adapter_from_record`, from the checkpoint's own record of the model).

The folder written into may be the run folder itself (model.lora.export_dir = run.dir: the adapter at
its top, as LLaMA-Factory's output_dir and vLLM's --lora-modules expect): peft saves into a hidden
folder inside it, and each file it wrote is then renamed over its name at the top. Nothing else in the
folder (run.json, config.yaml, events.jsonl, checkpoints/, ...) is touched.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastictrain.model.lora import apply_lora

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what peft needs; the config last


@dataclass
class AdapterExport:
    """What the run's end wrote into model.lora.export_dir."""

    files: list[str]  # names, adapter and tokenizer
    tokenizer: Any = None  # tools/tokenizer_files.py CopiedTokenizer; None: the run had no tokenizer
    notes: list[str] = field(default_factory=list)


def export_adapter(config: Any, checkpoint: Path, out_dir: Path) -> AdapterExport:
    """Write the checkpoint's adapter in peft's layout (adapter_config.json + adapter_model.safetensors)
    and the run's tokenizer beside it (as LLaMA-Factory writes its adapter's output dir).

    The model is built on the meta device (no memory for the base weights) just to give peft the
    structure; the adapter weights come from the checkpoint's fragments.
    """
    from elastictrain.checkpoint.model_record import tokenizer_folder
    from elastictrain.checkpoint.store import MANIFEST
    from elastictrain.checkpoint.zero_state import FragmentReader

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    reader = FragmentReader(
        [checkpoint / f["name"] for f in manifest["files"] if f["name"].endswith(".safetensors")]
    )
    with _empty_weights():
        wrapped = apply_lora(base_structure(config), config.model.lora)
    base = str(Path(config.model.pretrained).resolve()) if config.model.pretrained else None
    written = write_adapter(wrapped, reader, out_dir, base, torch.float32)
    source = tokenizer_folder(config.data.tokenizer, base)  # the one the run tokenized with
    result = AdapterExport([p.name for p in written])
    if source is not None:
        result.tokenizer, result.notes = adapter_tokenizer(source, out_dir)
        if result.tokenizer is not None:
            result.files += result.tokenizer.files
    return result


def adapter_tokenizer(source: str, out_dir: Path) -> tuple[Any, list[str]]:
    """Copy `source`'s tokenizer beside the adapter, recording its class, and check it tokenizes as
    `source` does: (tools/tokenizer_files.py CopiedTokenizer or None, notes). A failure is a note: the
    adapter is written and the run has finished; `elastictrain export` refuses such a tokenizer."""
    from elastictrain.tools.export_check import ExportCheckFailed, same_tokenizer
    from elastictrain.tools.tokenizer_files import copy_tokenizer

    if not Path(source).is_dir():
        return None, [f"no tokenizer written beside the adapter: {source} (the run's tokenizer) is gone"]
    try:
        copied = copy_tokenizer(source, out_dir)
    except (OSError, ValueError) as e:  # a full disk, a folder changed since the run loaded it
        return None, [f"no tokenizer written beside the adapter: copying {source} failed: {e}"]
    try:
        same_tokenizer(source, out_dir)
    except ExportCheckFailed as e:
        return copied, [f"{e} (it loads as {copied.loads_as}; the run tokenized with {copied.ran_with})"]
    return copied, []


def adapter_from_record(record: Any, reader: Any, out_dir: Path, dtype: torch.dtype) -> list[Path]:
    """The adapter of a checkpoint whose manifest records the model (checkpoint/model_record.py)."""
    from peft import get_peft_model

    from elastictrain.tools.export_models import lora_config, structure

    with _empty_weights():
        wrapped = get_peft_model(structure(record), lora_config(record))
    return write_adapter(wrapped, reader, out_dir, record.pretrained, dtype)


def write_adapter(
    wrapped: Any, reader: Any, out_dir: Path, base: str | None, dtype: torch.dtype
) -> list[Path]:
    """peft's save_pretrained of `wrapped` (a structure), with the adapter weights of the fragments.

    `base`: the base model's folder, named in adapter_config.json (None: a base built from a config).
    """
    expected = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    if expected != set(reader.params):
        raise ValueError(
            f"the checkpoint's parameters do not match the adapters of this config "
            f"(only in checkpoint: {sorted(set(reader.params) - expected)[:3]}, "
            f"only in model: {sorted(expected - set(reader.params))[:3]})"
        )
    state = {name: reader.full(name).to(dtype).contiguous() for name in sorted(reader.params)}
    wrapped.peft_config["default"].base_model_name_or_path = base
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / ".adapter-partial"  # in the folder: the renames stay on its file system
    shutil.rmtree(staging, ignore_errors=True)  # a crashed export's
    try:
        wrapped.save_pretrained(str(staging), state_dict=state)
        return _move_up(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_up(staging: Path, out_dir: Path) -> list[Path]:
    """Rename each file peft wrote into `staging` over its name in `out_dir`, adapter_config.json last
    (a reader of `out_dir` never sees a new config beside older weights)."""
    from elastictrain.storage.durable import fsync_dir

    names = sorted((p.name for p in staging.iterdir()), key=lambda n: (n == ADAPTER_FILES[0], n))
    if not all((staging / n).is_file() for n in names) or not set(ADAPTER_FILES) <= set(names):
        raise RuntimeError(f"peft wrote {names}; expected files, {ADAPTER_FILES} among them")
    moved = []
    for name in names:
        fsync_dir(staging / name)  # a file: fsync_dir opens it read-only and fsyncs it
        (staging / name).replace(out_dir / name)
        moved.append(out_dir / name)
    fsync_dir(out_dir)
    return moved


def _empty_weights() -> Any:
    """Parameters on the meta device, buffers real (some inits need them), in this thread only."""
    from elastictrain.model.build import forget_hf_deepspeed_config
    from elastictrain.model.empty import empty_weights

    forget_hf_deepspeed_config()  # a local run's finished worker may have left it set in this process
    return empty_weights()


def base_structure(config: Any) -> torch.nn.Module:
    """The model of this config as built before LoRA wraps it (on the caller's device context)."""
    from elastictrain.model.build import build_causal_lm

    m = config.model
    if m.factory:
        from elastictrain.user_code import user_model

        return user_model(config)
    if m.pretrained:
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(m.pretrained))
    return build_causal_lm(dict(m.hf_config))
