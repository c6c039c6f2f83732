"""An export's weights as safetensors shards, named and indexed as transformers' save_pretrained does.

`model.safetensors` when the weights fit in one shard, else `model-00001-of-0000N.safetensors` with
`model.safetensors.index.json`, split where save_pretrained splits (huggingface_hub's own planner).
Each file is written tensor by tensor from a source that makes one tensor at a time (the checkpoint's
fragments, or a merged model's parameters): the memory used is one tensor's, never a shard's.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # training.precision's names
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def dtype_named(name: str) -> torch.dtype:
    """`--dtype`'s value as a torch dtype; the training precision's names (bf16, ...) are accepted."""
    key = ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(
            f"--dtype: got {name!r}; expected one of {', '.join(DTYPES)} (or {', '.join(ALIASES)})"
        )
    return DTYPES[key]


def parse_size(size: str | int) -> int:
    """`--max-shard-size` in bytes: "5GB", "500MB", "1.5GB" (powers of 1000, as transformers) or bytes."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(size).strip()
    try:
        value = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(
            f"--max-shard-size: got {size!r}; expected a positive size such as 5GB, 500MB or bytes (1000000)"
        )
    return value


@dataclass(frozen=True)
class Tensors:
    """What to write: each tensor's name (in file order) and shape, and how to make it (float32)."""

    shapes: dict[str, tuple[int, ...]]
    get: Callable[[str], torch.Tensor]


def plan_shards(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, max_bytes: int
) -> dict[str, list[str]]:
    """file name -> tensor names, as save_pretrained would split them at `max_bytes`."""
    from huggingface_hub import split_state_dict_into_shards_factory

    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {name: _numel(shape) * itemsize for name, shape in shapes.items()}
    split = split_state_dict_into_shards_factory(
        sizes,  # type: ignore[arg-type] - the planner only asks get_storage_size about each value
        get_storage_size=lambda size: size,
        filename_pattern=WEIGHTS.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_bytes,
    )
    return dict(split.filename_to_tensors)


def write_shards(
    tensors: Tensors,
    folder: Path,
    dtype: torch.dtype,
    max_bytes: int,
    progress: Callable[[str], None] = lambda line: None,
) -> list[Path]:
    """Write the shards (and the index when there are several) into `folder`; the files written."""
    shards = plan_shards(tensors.shapes, dtype, max_bytes)
    written = []
    for i, (file_name, names) in enumerate(shards.items(), start=1):
        path = folder / file_name
        size = write_safetensors(path, names, tensors, dtype)
        written.append(path)
        progress(f"  shard {i}/{len(shards)}: {file_name} ({len(names)} tensors, {size_text(size)})")
    if len(shards) > 1:
        itemsize = torch.empty((), dtype=dtype).element_size()
        index = {
            "metadata": {
                "total_parameters": sum(_numel(s) for s in tensors.shapes.values()),
                "total_size": sum(_numel(s) for s in tensors.shapes.values()) * itemsize,
            },
            "weight_map": {name: file_name for file_name, names in shards.items() for name in names},
        }
        written.append(folder / INDEX)
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def write_safetensors(path: Path, names: Sequence[str], tensors: Tensors, dtype: torch.dtype) -> int:
    """One safetensors file, streamed tensor by tensor, fsynced; its size in bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = _numel(tensors.shapes[name]) * itemsize
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(tensors.shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors pads its header with spaces to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name in names:
            tensor = tensors.get(name)
            if tuple(tensor.shape) != tuple(tensors.shapes[name]):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tensors.shapes[name]}")
            data = tensor.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def size_text(size: int) -> str:
    """Bytes as people read them: 41.2 kB, 1.5 GB (powers of 1000, as --max-shard-size)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
