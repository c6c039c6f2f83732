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

# In a new process (transformers not imported yet): install the cache, count the model sources read
# (`open` of a .py file under transformers/models: what the scan reads; imports read their .pyc), import
# what a worker imports, and compare the answers for the models folder (the scan `import transformers`
# runs) and for its package file with the original function's.
SCRIPT = """
import json, sys
reads = []
def count(event, args):
    path = args[0] if event == "open" else None
    if isinstance(path, str) and "/transformers/models/" in path and path.endswith(".py"):
        reads.append(path)
sys.addaudithook(count)
from elastictrain.compat.transformers.import_structure import cache_import_structure
cache_import_structure()
import transformers.modeling_utils
from transformers import AutoConfig, LlamaForCausalLM
AutoConfig.for_model("llama")
import transformers.models as models
from transformers.utils import import_utils
read = len(reads)  # before the comparison below, which reads every source again
wrapper = import_utils.create_import_structure_from_path
original = wrapper.original.__wrapped__  # transformers' own, without its lru_cache
package = models.__file__
folder = models.__path__[0]
same = wrapper(package) == original(package) and wrapper(folder) == original(folder)
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
