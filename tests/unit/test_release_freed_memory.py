"""A rank that drops its engine gives the allocator's freed memory back before building the next one
(a survivor at 1B otherwise held its old engine's 8 GB beside the new one and was killed for memory)."""

from __future__ import annotations

import os
import sys

import pytest

from elastictrain.worker.host_memory import release_freed_memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_memory_freed_below_a_live_allocation_goes_back_to_the_system():
    # 400 MB in 16 KiB blocks (heap, not mmap) with a small block kept alive after every 256 of them,
    # so the freed blocks cannot go back from the heap's top: glibc keeps those pages until trimmed.
    blocks, pins = [], []
    for i in range(25600):
        block = bytearray(16 << 10)
        block[::4096] = b"\x01" * 4  # touch every page (no temporary of the block's size)
        blocks.append(block)
        if i % 256 == 255:
            pins.append(bytearray(1024))
    del blocks, block
    kept = _rss_bytes()
    assert release_freed_memory()
    released = kept - _rss_bytes()
    assert released > 100 << 20, f"only {released >> 20} MiB went back"
    assert len(pins) == 100
