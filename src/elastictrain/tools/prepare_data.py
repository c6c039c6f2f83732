"""`elastictrain prepare-data IN... OUT --tokenizer DIR`: local text, JSON lines or Parquet to token shards.

Records are read in order (a text file: one record per line, as `data.source: hf` reads it; JSON lines
and Parquet: the `--text-field` column), tokenized in parallel worker processes with a tokenizer from
a local folder (an end-of-text token after each record when the tokenizer has one), and written as
flat `uint16` shards (`uint32` when the vocabulary needs more than 16 bits) of `--shard-tokens` tokens.
`index.json` (data/token_index.py) records the shards, the tokenizer, its vocabulary size, the dtype
and the token count: `train` checks the shards against it and the vocabulary against the model's.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from elastictrain.data.token_index import DTYPES, build_index, write_index

RECORDS_PER_TASK = 512
_tokenizer: Any = None  # in each worker process, loaded once


def read_records(path: Path, text_field: str) -> Iterator[str]:
    """The text of each record of one input file, in order."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if text_field not in record:
                    raise ValueError(f"--text-field: got {text_field!r}; {path}:{n} has {', '.join(record)}")
                yield str(record[text_field])
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if text_field not in table.schema_arrow.names:
            names = ", ".join(table.schema_arrow.names)
            raise ValueError(f"--text-field: got {text_field!r}; the columns of {path} are {names}")
        for batch in table.iter_batches(columns=[text_field]):
            yield from (str(t) for t in batch.column(0).to_pylist())
    elif suffix in (".txt", ".text", ".md"):
        with path.open(encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f if line.strip())
    else:
        raise ValueError(f"IN: {path} has an unknown extension; expected .txt, .jsonl, .json or .parquet")


def input_files(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        if item.is_dir():
            files.extend(sorted(p for p in item.rglob("*") if p.is_file() and not p.name.startswith(".")))
        elif item.is_file():
            files.append(item)
        else:
            raise ValueError(
                f"IN: {item} does not exist; expected text, JSON lines or Parquet files or folders"
            )
    if not files:
        raise ValueError(f"IN: no input files in {', '.join(map(str, inputs))}")
    return files


def _load(folder: str) -> None:
    global _tokenizer
    from elastictrain.data.hf_files import load_tokenizer

    _tokenizer = load_tokenizer(folder)


def _encode(texts: list[str]) -> list[int]:
    eos = [_tokenizer.eos_token_id] if _tokenizer.eos_token_id is not None else []
    ids = _tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [t for one in ids for t in (*one, *eos)]


def _batches(files: list[Path], text_field: str, on_file: Callable[[], None]) -> Iterator[list[str]]:
    batch: list[str] = []
    for path in files:
        for text in read_records(path, text_field):
            batch.append(text)
            if len(batch) == RECORDS_PER_TASK:
                yield batch
                batch = []
        on_file()
    if batch:
        yield batch


class ShardWriter:
    """Cuts the token stream into files of `shard_tokens` tokens: shard-00000.bin, shard-00001.bin, ..."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int) -> None:
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.buffer: list[int] = []
        self.count = 0

    def add(self, ids: list[int]) -> None:
        self.buffer.extend(ids)
        while len(self.buffer) >= self.shard_tokens:
            self._write(self.buffer[: self.shard_tokens])
            del self.buffer[: self.shard_tokens]

    def close(self) -> None:
        if self.buffer:
            self._write(self.buffer)
            self.buffer = []

    def _write(self, ids: list[int]) -> None:
        path = self.out / f"shard-{self.count:05d}.bin"
        np.asarray(ids, dtype=DTYPES[self.dtype]).tofile(path)
        self.count += 1


def prepare_data(
    inputs: list[Path],
    out: Path,
    tokenizer: str,
    *,
    text_field: str = "text",
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `inputs` into shards in `out` (new or empty); returns the index written."""
    from elastictrain.data.hf_files import load_tokenizer

    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens: got {shard_tokens}; expected a positive number of tokens")
    if workers < 1:
        raise ValueError(f"--workers: got {workers}; expected >= 1")
    files = input_files(inputs)
    vocab = len(load_tokenizer(tokenizer))  # its errors name the folder, before anything is written
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"OUT: {out} exists and is not an empty folder; give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    writer = ShardWriter(out, dtype, shard_tokens)
    with (
        _progress(progress, len(files)) as advance,
        ProcessPoolExecutor(workers, initializer=_load, initargs=(tokenizer,)) as pool,
    ):
        window: deque[Future[list[int]]] = deque()
        for batch in _batches(files, text_field, advance):
            window.append(pool.submit(_encode, batch))
            if len(window) > 2 * workers:  # bounded memory, order kept
                writer.add(window.popleft().result())
        while window:
            writer.add(window.popleft().result())
    writer.close()
    meta = {
        "tokenizer": str(Path(tokenizer).resolve()),
        "vocab_size": vocab,
        "sources": [str(f) for f in files],
    }
    index = build_index(out, dtype, meta)
    write_index(out, index)
    return index


class _progress:
    """A progress bar over the input files (rich), or nothing."""

    def __init__(self, show: bool, total: int) -> None:
        self.show, self.total = show, total
        self.bar: Any = None

    def __enter__(self) -> Callable[[], None]:
        if not self.show:
            return lambda: None
        from rich.progress import Progress

        self.bar = Progress(transient=False)
        self.bar.start()
        task = self.bar.add_task("tokenizing files", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
