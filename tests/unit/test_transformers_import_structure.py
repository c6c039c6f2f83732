"""transformers' import structure is read from elastictrain's cache in a new process, and is the same as
the one transformers computes (compat/transformers/import_structure.py)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# In a new process (transformers.models not imported yet): install the cache, count transformers' reads
# of model sources, import what a worker imports, and compare the answer for the models folder with the
# original function's.
SCRIPT = """
import json, sys
from elastictrain.compat.transformers.import_structure import cache_import_structure
from transformers.utils import import_utils
original = import_utils.create_import_structure_from_path
reads = []
fetch = import_utils.fetch__all__
import_utils.fetch__all__ = lambda content: reads.append(1) or fetch(content)
cache_import_structure()
import transformers.modeling_utils
from transformers import LlamaForCausalLM
import transformers.models as models
read = len(reads)  # before the comparison below, which reads every source again
path = models.__file__
same = import_utils.create_import_structure_from_path(path) == original.__wrapped__(path)
print(json.dumps({"reads": read, "same": same, "llama": LlamaForCausalLM.__name__}))
"""


def fresh_process(cache: Path) -> dict:
    env = {**os.environ, "ELASTICTRAIN_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A first process, which computes the structure and stores it: each test reads a copy of its cache."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, fresh_process(cache)


def copied(cache: Path, to: Path) -> Path:
    shutil.copytree(cache, to / "cache")
    return to / "cache"


def test_a_second_process_reads_no_model_source_and_gets_the_structure_transformers_computes(
    first: tuple[Path, dict], tmp_path: Path
):
    cache, made = first
    stored = list(cache.glob("transformers-*-import-structure.pkl"))
    assert len(stored) == 1 and made["reads"] > 1000 and made["same"], made
    second = fresh_process(copied(cache, tmp_path))
    assert second == {"reads": 0, "same": True, "llama": "LlamaForCausalLM"}, second


def test_a_cache_made_for_another_install_is_not_used(first: tuple[Path, dict], tmp_path: Path):
    cache, made = first
    cache = copied(cache, tmp_path)
    store = next(cache.glob("transformers-*-import-structure.pkl"))
    kept = pickle.loads(store.read_bytes())
    wrong = {path: {frozenset(): {"nowhere": {"Nothing"}}} for path in kept["structures"]}
    store.write_bytes(pickle.dumps({"stamp": (kept["stamp"][0], kept["stamp"][1] + 1), "structures": wrong}))
    again = fresh_process(cache)  # the model folders changed since (another mtime): computed anew
    assert again == made and json.dumps(again)
