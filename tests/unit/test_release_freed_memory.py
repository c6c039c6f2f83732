"""A rank that drops its engine gives the allocator's freed memory back before building the next one
(a survivor at 1B otherwise held its old engine's 8 GB beside the new one and was killed for memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastictrain.cluster.allocator import allocator_env

GLIBC_PROBE = """
import os
from elastictrain.host.memory import release_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
# 400 MB in 16 KiB blocks (heap, not mmap) with a small block kept alive after every 256 of them,
# so the freed blocks cannot go back from the heap's top: glibc keeps those pages until trimmed.
blocks, pins = [], []
for i in range(25600):
    block = bytearray(16 << 10)
    block[::4096] = b"\\x01" * 4  # touch every page (no temporary of the block's size)
    blocks.append(block)
    if i % 256 == 255:
        pins.append(bytearray(1024))
del blocks, block
kept = rss()
print(release_freed_memory(), (kept - rss()) >> 20, len(pins))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_memory_freed_below_a_live_allocation_goes_back_to_the_system():
    # In a fresh process: in the test process, what ran before decides which arena and which mmap
    # threshold the blocks get (a full suite once saw 5 MiB go back).
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", GLIBC_PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0] == "glibc"
    assert int(out[1]) > 100, f"only {out[1]} MiB went back"
    assert out[2] == "100"


JEMALLOC_PROBE = """
import os
from elastictrain.host.memory import release_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [bytearray(1 << 20) for _ in range(400)]  # zero-filled: every page touched
del blocks
kept = rss()
print(release_freed_memory(), (kept - rss()) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD")
def test_jemalloc_set_to_keep_freed_pages_purges_them_when_an_engine_is_dropped():
    env = {**os.environ, **allocator_env("jemalloc", {})}
    out = subprocess.run(
        [sys.executable, "-c", JEMALLOC_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert out[0] == "jemalloc"
    assert int(out[1]) > 300, f"only {out[1]} MiB went back"
