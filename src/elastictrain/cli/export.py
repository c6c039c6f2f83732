"""`elastictrain export`: a checkpoint as a model folder to serve (tools/export.py; docs/export.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from elastictrain.cli.output import choose, err, fail, out
from elastictrain.cli.plot import log_export


def export_command(
    checkpoint: Annotated[str, typer.Argument(help="a checkpoint folder, checkpoints/ folder or run folder")],
    out_dir: Annotated[
        Path, typer.Option("--out", help="output folder (new, empty, or an earlier export: replaced)")
    ],
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

    path = choose(checkpoint)
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


def _how_to_load(kind: str, folder: Path) -> str:
    if kind == "adapter":
        return (
            f"peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {str(folder)!r}) "
            "(BASE: base_model_name_or_path in its adapter_config.json)"
        )
    if kind == "state_dict":
        return "your model's load_state_dict(safetensors.torch.load_file(FILE)), for each .safetensors file"
    return f"AutoModelForCausalLM.from_pretrained({str(folder)!r}) or `vllm serve {folder}`"
