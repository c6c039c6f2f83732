"""`data.source: tokens`: shards of token ids as one stream, memory-mapped, read by global position.

The folder's layout and its index: data/token_index.py. Sample i is tokens [i*seq_len, (i+1)*seq_len)
of the shards in name order, so a sample may span two shards; only the bytes a sample needs are read.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elastictrain.data.token_index import load_index, open_shard


class TokenShards:
    """Map-style dataset: sample i is tokens [i*seq_len, (i+1)*seq_len) of the shards' one stream."""

    def __init__(self, folder: str, seq_len: int, dtype: str | None = None) -> None:
        self.folder = Path(folder)
        self.seq_len = seq_len
        index = load_index(self.folder, dtype)
        self.dtype = str(index["dtype"])
        self.names = [s["name"] for s in index["shards"]]
        counts = [int(s["tokens"]) for s in index["shards"]]
        self.starts = [sum(counts[:k]) for k in range(len(counts))]  # global offset of each shard
        self.total = sum(counts)
        self._maps: dict[int, np.ndarray] = {}  # opened on first use, in the process that reads
        if self.total < seq_len:
            raise ValueError(
                f"data.path: {folder} holds {self.total} tokens, fewer than data.seq_len={seq_len}"
            )

    def __len__(self) -> int:
        return self.total // self.seq_len

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            self._maps[k] = open_shard(self.folder / self.names[k], self.dtype)
        return self._maps[k]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, across shard boundaries."""
        parts = []
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            shard = self._shard(k)
            lo = start - self.starts[k]
            hi = min(stop - self.starts[k], shard.shape[0])
            parts.append(np.asarray(shard[lo:hi]))
            start += hi - lo
            k += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        return torch.from_numpy(self.tokens(start, start + self.seq_len).astype(np.int64))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # memory maps are reopened where the dataset is used
