"""`elastictrain export`: a checkpoint as a model folder to serve (tools/export.py; docs/export.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from elastictrain.cli.output import choose, err, fail, out
from elastictrain.cli.plot import log_export


def export_command(
    checkpoint: Annotated[
        str | None, typer.Argument(help="a checkpoint folder, checkpoints/ folder or run folder")
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="output folder (new, empty, or an earlier export: replaced)")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="a LLaMA-Factory merge YAML (model_name_or_path, adapter_name_or_path, "
            "export_dir, export_size): what it names, merged and checked",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="float32 | bfloat16 | float16 (default: the training precision's, bf16 -> bfloat16)",
        ),
    ] = None,
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size", help="split the weights into shards of at most this (5GB, 500MB, bytes)"
        ),
    ] = "5GB",
    merge_lora: Annotated[
        bool,
        typer.Option(
            "--merge-lora", help="LoRA run: write the base with the adapter merged in, not the adapter"
        ),
    ] = False,
    log_to_mlflow: Annotated[
        bool, typer.Option("--log-to-mlflow", help="also log the exported model to the run's MLflow run")
    ] = False,
) -> None:
    """Write a model folder that transformers, peft and vLLM load: config, generation config, tokenizer
    and safetensors shards (or a LoRA adapter), checked against the checkpoint before it is published."""
    from elastictrain.checkpoint.store import CheckpointError, verify_checkpoint
    from elastictrain.tools.export import ExportOptions, export_checkpoint
    from elastictrain.tools.export_check import ExportCheckFailed

    if config is not None:
        if checkpoint is not None or out_dir is not None:
            fail(
                "--config: the merge file names what to export and where (export_dir): no CHECKPOINT or --out"
            )
        request = _merge_request(config)
        if request.adapter is not None:  # a peft adapter folder, not a run of ours
            _merge_adapter(request)
            return
        checkpoint, out_dir, max_shard_size, merge_lora = (
            str(request.run),
            Path(request.out),
            request.max_shard_size,
            True,
        )
    if checkpoint is None or out_dir is None:
        fail("expected CHECKPOINT and --out DIR (or --config FILE, a LLaMA-Factory merge file)")
    path = choose(checkpoint)
    if config is not None:
        merge_lora = _merges_lora_of_base(path, request.base)
    options = ExportOptions(
        dtype, max_shard_size, merge_lora, progress=lambda line: out.print(line, markup=False)
    )
    try:
        problems = verify_checkpoint(path)  # never read a checkpoint whose files do not match its manifest
        if problems:
            fail(f"{path} does not verify, not exporting it:\n" + "\n".join(problems), code=1)
        result = export_checkpoint(path, out_dir, options)
    except ExportCheckFailed as e:
        fail(f"export check failed: {e}. Nothing was written to {out_dir}", code=1)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    for note in result.notes:
        err.print(Text.assemble(("note: ", "bold yellow"), note))
    if result.checked is not None:
        out.print(result.checked.line(result.dtype), markup=False)
    out.print(f"exported {path} to {out_dir} ({result.kind}, {result.dtype}): {', '.join(result.files)}")
    out.print(f"load it with {_how_to_load(result.kind, out_dir)}", markup=False)
    if log_to_mlflow:
        log_export(path, out_dir)


def _merge_request(config: Path):  # noqa: ANN202 - MergeRequest, imported lazily
    from omegaconf import OmegaConf

    from elastictrain.config.llamafactory.export_file import read_merge_file

    try:
        raw = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
    except Exception as e:  # noqa: BLE001 - a missing file or YAML syntax error, said as such
        fail(f"--config: {config} does not read as YAML ({e})")
    if not isinstance(raw, dict):
        fail(f"--config: {config} holds no mapping of keys")
    request = read_merge_file(raw)  # type: ignore[arg-type]
    if request.problems:
        fail(f"LLaMA-Factory merge file {config}:\n" + "\n".join(request.problems))
    for line in request.notices:
        err.print(Text.assemble(("note: ", "bold yellow"), line))
    return request


def _merge_adapter(request) -> None:  # noqa: ANN001 - MergeRequest
    from elastictrain.tools.export_check import ExportCheckFailed
    from elastictrain.tools.merge_adapter import merge_adapter_folder

    out_dir = Path(request.out)
    try:
        result = merge_adapter_folder(
            request.base,
            request.adapter,
            out_dir,
            request.max_shard_size,
            lambda line: out.print(line, markup=False),
        )
    except ExportCheckFailed as e:
        fail(f"export check failed: {e}. Nothing was written to {out_dir}", code=1)
    except (OSError, ValueError) as e:
        fail(str(e))
    if result.checked is not None:
        out.print(result.checked.line(result.dtype), markup=False)
    out.print(
        f"merged {request.adapter} into {request.base}: {out_dir} ({result.dtype}): {', '.join(result.files)}"
    )
    out.print(f"load it with {_how_to_load(result.kind, out_dir)}", markup=False)


def _merges_lora_of_base(checkpoint: Path, base: str | None) -> bool:
    """Whether the run of `checkpoint` is a LoRA run (its adapter then merged); a merge file's
    model_name_or_path must be the base it trained (both read from the manifest's model record)."""
    import json

    from elastictrain.checkpoint.model_record import model_record
    from elastictrain.checkpoint.store import MANIFEST

    record = model_record(json.loads((checkpoint / MANIFEST).read_text()))
    trained = record.pretrained
    if base and trained and Path(base).resolve() != Path(trained).resolve():
        fail(
            f"model_name_or_path: got {base}; the run of {checkpoint} trained {trained}: give that base "
            "(or leave the adapter's own base to the run: its checkpoint holds it)"
        )
    return record.peft is not None


def _how_to_load(kind: str, folder: Path) -> str:
    if kind == "adapter":
        return (
            f"peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {str(folder)!r}) "
            "(BASE: base_model_name_or_path in its adapter_config.json)"
        )
    if kind == "state_dict":
        return "your model's load_state_dict(safetensors.torch.load_file(FILE)), for each .safetensors file"
    return f"AutoModelForCausalLM.from_pretrained({str(folder)!r}) or `vllm serve {folder}`"
