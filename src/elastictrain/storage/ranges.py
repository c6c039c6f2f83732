"""Read a safetensors file on an object store by byte ranges: its header once, then only the slices
asked for, as `safe_open` reads a local file (a rank loading at a new world size reads its slices
of the old ranks' objects, never whole objects).

The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data
offsets; `__metadata__`), then the tensors' bytes.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from elastictrain.storage.objects import ObjectPath

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _Slice:
    def __init__(self, handle: RangeSafetensors, name: str) -> None:
        self._handle = handle
        self._name = name

    def __getitem__(self, index: slice) -> torch.Tensor:
        return self._handle.read_flat(self._name, index)


class RangeSafetensors:
    """The part of safetensors' `safe_open` handle that checkpoint readers use, over byte ranges."""

    def __init__(self, path: ObjectPath) -> None:
        self.path = path
        (length,) = struct.unpack("<Q", path.read_range(0, 8))
        header = json.loads(path.read_range(8, 8 + length))
        self._meta: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict[str, Any]] = header
        self._base = 8 + length

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def metadata(self) -> dict[str, str]:
        return dict(self._meta)

    def get_slice(self, name: str) -> _Slice:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return _Slice(self, name)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        return self.read_flat(name, slice(None)).view(tuple(entry["shape"]))

    def read_flat(self, name: str, index: slice) -> torch.Tensor:
        """Elements `index` (a step-1 slice) of the tensor, flattened."""
        entry = self._entries[name]
        dtype = _DTYPES[entry["dtype"]]
        numel = math.prod(entry["shape"])
        start, stop, step = index.indices(numel)
        if step != 1:
            raise ValueError(f"{self.path}: only contiguous slices are read, not step {step}")
        size = torch.empty((), dtype=dtype).element_size()
        begin = self._base + int(entry["data_offsets"][0])
        if stop <= start:
            return torch.empty(0, dtype=dtype)
        data = self.path.read_range(begin + start * size, begin + stop * size)
        return torch.frombuffer(bytearray(data), dtype=dtype)


def open_safetensors(path: Any) -> Any:
    """A safetensors handle: safetensors' own (memory-mapped) for a local file, ranges for an object."""
    if isinstance(path, ObjectPath):
        return RangeSafetensors(path)
    from safetensors import safe_open

    return safe_open(str(path), framework="pt", device="cpu")
