"""CLI command `prepare-data`: local text, JSON lines or Parquet to token shards for `data.source: tokens`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from elastictrain.cli.output import fail, out


def prepare_data_command(
    paths: Annotated[
        list[Path], typer.Argument(help="IN... OUT: input files or folders, then the output folder")
    ],
    tokenizer: Annotated[
        Path, typer.Option("--tokenizer", help="a local tokenizer folder (save_pretrained)")
    ],
    text_field: Annotated[
        str, typer.Option("--text-field", help="the text column of JSON lines / Parquet")
    ] = "text",
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="tokens per shard file")] = 100_000_000,
    workers: Annotated[int, typer.Option("--workers", help="tokenizer processes (default: CPUs)")] = 0,
) -> None:
    """Tokenize local text, JSON lines or Parquet files into .bin shards with index.json (in parallel)."""
    from elastictrain.tools.prepare_data import prepare_data

    if len(paths) < 2:
        fail("prepare-data: expected IN... OUT (one or more inputs, then the output folder)")
    if not tokenizer.is_dir():
        fail(f"--tokenizer: got {str(tokenizer)!r}; expected an existing tokenizer folder (save_pretrained)")
    *inputs, target = paths
    try:
        index = prepare_data(
            inputs,
            target,
            str(tokenizer),
            text_field=text_field,
            shard_tokens=shard_tokens,
            workers=workers or os.cpu_count() or 1,
        )
    except ValueError as e:
        fail(str(e))
    out.print(
        f"{target}: {index['tokens']} tokens in {len(index['shards'])} shard(s), {index['dtype']}, "
        f"vocabulary {index['vocab_size']}; train with data.source=tokens data.path={target}"
    )
