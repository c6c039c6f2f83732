"""`elastictrain export`: a checkpoint as a model folder that transformers, peft and vLLM load.

What is written depends on the checkpoint's record of its model (checkpoint/model_record.py):
- a transformers model: its config, generation config, tokenizer (with its chat template) and weights
  as safetensors shards (tools/export_shards.py);
- a LoRA run: the adapter in peft's layout (tools/adapter.py), or with `merge_lora` the base with the
  adapter merged in (peft's merge_and_unload), a plain model;
- a model that is not a transformers model (a factory's own module): its state dict, no config.
Everything is written into a hidden sibling folder, checked (tools/export_check.py), and only then
renamed to `out_dir`: a failed export leaves nothing that looks like a finished one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastictrain.checkpoint.model_record import ModelRecord, model_record, transformers_config
from elastictrain.checkpoint.store import MANIFEST
from elastictrain.storage.durable import fsync_dir
from elastictrain.tools import export_check as check
from elastictrain.tools.export_shards import Tensors, dtype_named, parse_size, write_shards
from elastictrain.tools.tokenizer_files import copy_tokenizer

RECORD = "elastictrain-export.json"  # what was exported from where: also marks a folder as an export


@dataclass(frozen=True)
class ExportOptions:
    dtype: str | None = None  # None: the training precision's
    max_shard_size: str | int = "5GB"
    merge_lora: bool = False
    progress: Callable[[str], None] = field(default=lambda line: None)


@dataclass
class ExportResult:
    out: Path
    kind: str  # model | adapter | merged | state_dict
    dtype: str
    files: list[str]
    checked: check.Checked | None
    notes: list[str]


def export_checkpoint(checkpoint: Any, out_dir: Path, options: ExportOptions | None = None) -> ExportResult:
    """Export `checkpoint` (a committed checkpoint folder, local or on an object store) to `out_dir`."""
    from elastictrain.checkpoint.zero_state import FragmentReader

    opts = options or ExportOptions()
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    record = model_record(manifest)
    dtype = dtype_named(opts.dtype or record.precision)
    dtype_name = _dtype_text(dtype)
    max_bytes = parse_size(opts.max_shard_size)
    check_out_folder(out_dir)
    if opts.merge_lora and record.peft is None:
        raise ValueError(f"--merge-lora: {checkpoint} is not of a LoRA run (model.lora.enabled was false)")
    if record.peft is not None and not record.is_transformers:
        raise ValueError(
            f"{checkpoint}: a LoRA run of a model that is not a transformers model ({record.architecture}); "
            "`export` rebuilds only transformers models: the run wrote its adapter to model.lora.export_dir"
        )
    files = [checkpoint / f["name"] for f in manifest["files"] if f["name"].endswith(".safetensors")]
    reader = FragmentReader(files)
    staging = out_dir.with_name(f".{out_dir.name}.export-partial")
    shutil.rmtree(staging, ignore_errors=True)  # a crashed export's
    staging.mkdir(parents=True)
    writer = _Writer(record, reader, staging, dtype, max_bytes, opts.progress)
    try:
        if record.peft is not None:
            result = writer.merged() if opts.merge_lora else writer.adapter()
        elif record.is_transformers:
            result = writer.model()
        else:
            result = writer.state_dict()
        kind, checked = result
        notes = writer.notes
        if kind != "state_dict":
            notes += writer.tokenizer()
        provenance = {"checkpoint": str(checkpoint), "step": manifest.get("step"), "kind": kind}
        provenance |= {"dtype": dtype_name, "run_id": manifest.get("run_id")}
        provenance["check"] = dataclasses.asdict(checked) if checked else None
        (staging / RECORD).write_text(json.dumps(provenance, indent=1) + "\n")
        for path in staging.iterdir():
            _fsync(path)
        fsync_dir(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    names = sorted(p.name for p in staging.iterdir())
    publish(staging, out_dir)
    return ExportResult(out_dir, kind, dtype_name, names, checked, notes)


class _Writer:
    """The kinds of export, each written into `staging` and checked there."""

    def __init__(
        self,
        record: ModelRecord,
        reader: Any,
        staging: Path,
        dtype: torch.dtype,
        max_bytes: int,
        progress: Callable[[str], None],
    ) -> None:
        self.record, self.reader, self.staging = record, reader, staging
        self.dtype, self.max_bytes, self.progress = dtype, max_bytes, progress
        self.notes: list[str] = []

    def model(self) -> tuple[str, check.Checked]:
        from elastictrain.tools.export_models import (
            check_same_parameters,
            full_model,
            parameter_shapes,
            structure,
        )

        shapes = parameter_shapes(structure(self.record))
        check_same_parameters(
            set(shapes), set(self.reader.params), f"{self.record.architecture or 'the model'}"
        )
        self.progress(f"writing {len(shapes)} tensors as {_dtype_text(self.dtype)}")
        write_shards(
            Tensors(shapes, self.reader.full), self.staging, self.dtype, self.max_bytes, self.progress
        )
        self._configs()
        self.progress("checking: the checkpoint's model against the export, on a few sequences")
        model = full_model(self.record, self.reader)
        reference = self._reference(model, None)
        del model
        return "model", self._check_model(reference)

    def merged(self) -> tuple[str, check.Checked]:
        from elastictrain.tools.export_models import lora_model, parameter_shapes, pretrained_base

        base = pretrained_base(self.record)  # refused first where the base is in no file
        self.progress(f"merging the adapter into {self.record.pretrained}")
        wrapped = lora_model(self.record, self.reader, base)
        del base
        ids = check.sample_ids(self._vocab())
        before = check.logits(wrapped, ids)
        merged = wrapped.merge_and_unload()  # peft's: W + scale * B @ A, the LoRA layers removed
        check.round_parameters(merged, self.dtype)
        reference = check.Reference(ids, before, check.logits(merged, ids))
        params = dict(merged.named_parameters())
        tensors = Tensors(parameter_shapes(merged), lambda name: params[name].data)
        write_shards(tensors, self.staging, self.dtype, self.max_bytes, self.progress)
        del merged, wrapped, tensors
        self._configs()
        return "merged", self._check_model(reference)

    def adapter(self) -> tuple[str, check.Checked | None]:
        from elastictrain.tools.adapter import adapter_from_record
        from elastictrain.tools.export_models import lora_model, pretrained_base

        adapter_from_record(self.record, self.reader, self.staging, self.dtype)
        self.progress(f"wrote the adapter ({len(self.reader.params)} tensors, {_dtype_text(self.dtype)})")
        if not self.record.pretrained:
            self.notes.append(
                f"not checked: the base model was built from model.{self.record.source}, not loaded from a "
                "folder, so no file holds the base an adapter is applied to"
            )
            return "adapter", None
        from peft import PeftModel

        self.progress(f"checking: the run's model ({self.record.pretrained} + adapter) against the export")
        wrapped = lora_model(self.record, self.reader, pretrained_base(self.record))
        trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
        reference = self._reference(wrapped, trainable)
        del wrapped
        loaded = PeftModel.from_pretrained(pretrained_base(self.record), str(self.staging)).float().eval()
        return "adapter", check.compare(reference, check.logits(loaded, reference.ids), self.dtype)

    def state_dict(self) -> tuple[str, check.Checked | None]:
        from safetensors import safe_open

        shapes = {name: tuple(self.reader.params[name].shape) for name in sorted(self.reader.params)}
        written = write_shards(
            Tensors(shapes, self.reader.full), self.staging, self.dtype, self.max_bytes, self.progress
        )
        for path in (p for p in written if p.suffix == ".safetensors"):  # read back, compared exactly
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    if not torch.equal(f.get_tensor(name), self.reader.full(name).to(self.dtype)):
                        raise check.ExportCheckFailed(f"{path.name}: {name} does not read back as written")
        self.notes.append(
            f"not a transformers model ({self.record.architecture}, from model.{self.record.source}): "
            "wrote its state dict only, no config.json; load it into your own module with "
            "model.load_state_dict(safetensors.torch.load_file(FILE)) for each .safetensors file"
        )
        return "state_dict", None

    # -- pieces --
    def _vocab(self) -> int:
        return int(transformers_config(self.record).get_text_config().vocab_size)

    def _reference(self, model: torch.nn.Module, only: set[str] | None) -> check.Reference:
        ids = check.sample_ids(self._vocab())
        before = check.logits(model, ids)
        check.round_parameters(model, self.dtype, only)
        return check.Reference(ids, before, check.logits(model, ids))

    def _configs(self) -> None:
        """config.json (with the export's dtype and class) and generation_config.json where there is one."""
        config = transformers_config(self.record)
        config.dtype = self.dtype
        if self.record.architecture:
            config.architectures = [self.record.architecture]
        config.save_pretrained(self.staging)
        if self.record.generation_config is not None:
            from transformers import GenerationConfig

            GenerationConfig.from_dict(dict(self.record.generation_config)).save_pretrained(self.staging)

    def _check_model(self, reference: check.Reference) -> check.Checked:
        from elastictrain.tools.export_models import model_class

        loaded, info = model_class(self.record).from_pretrained(
            str(self.staging), dtype=self.dtype, local_files_only=True, output_loading_info=True
        )
        check.loaded_cleanly(info, "the export")
        return check.compare(reference, check.logits(loaded.float().eval(), reference.ids), self.dtype)

    def tokenizer(self) -> list[str]:
        """The run's tokenizer files, copied as they are (chat template included), with the class the run
        tokenized with recorded where the export would load another (tools/tokenizer_files.py); checked
        to tokenize as the run's."""
        source = self.record.tokenizer
        if source is None:
            return ["no tokenizer: the run had neither data.tokenizer nor a pretrained folder holding one"]
        if not Path(source).is_dir():
            return [f"no tokenizer: {source} (the run's tokenizer) is gone"]
        copied = copy_tokenizer(source, self.staging)  # after config.json: it decides the class too
        try:
            check.same_tokenizer(source, self.staging)
        except check.ExportCheckFailed as e:
            if copied.loads_as == copied.ran_with:
                raise
            model_type = (self.record.config or {}).get("model_type")
            raise check.ExportCheckFailed(
                f"{e}: it loads as {copied.loads_as}, the run tokenized with {copied.ran_with}; with a "
                f"config.json beside it (model_type {model_type!r}) transformers loads that class whatever "
                "tokenizer_config.json names"
            ) from e
        recorded = f" (tokenizer_class {copied.ran_with}, as the run loaded it)" if copied.recorded else ""
        self.progress(f"copied the tokenizer of {source}: {', '.join(copied.files)}{recorded}")
        return []


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_out_folder(out: Path) -> None:
    """`out` may be new, an empty folder or an earlier export (replaced); anything else is kept."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} is a file; expected a folder (new, empty, or an earlier export)")
    if out.is_dir() and any(out.iterdir()) and not (out / RECORD).is_file():
        raise ValueError(
            f"--out: {out} is a non-empty folder that is not an earlier export (no {RECORD}); it is kept as "
            "it is. Expected a new or empty folder, or an earlier output of `elastictrain export` (replaced)"
        )


def publish(staging: Path, out: Path) -> None:
    """Rename the checked folder into place; an earlier export there is replaced."""
    old = out.with_name(f".{out.name}.export-old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    staging.rename(out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
