"""A worker's warm-up, and any process that first builds a model, imports transformers' modeling code
the cheap way (compat/transformers/preload.py `import_modeling_code`): its import structure from
elastictrain's cache, SciPy's optimizer and boto3 deferred, even though the warm-up's patch checks import that
code before the model's own preload does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A new process, as a Ray worker is: the warm-up a TrainWorker runs before it joins an attempt.
SCRIPT = """
import json, sys
from elastictrain.config.loader import load_config
from elastictrain.worker.actor import TrainWorker
config = load_config(sys.argv[1], ["data.generated_chars=20000"])
TrainWorker("w0", use_gpu=False, in_ray=False).warmup(config)
print(json.dumps({
    "modeling_imported": "transformers.modeling_utils" in sys.modules,
    "scipy_optimize_imported": "scipy.optimize" in sys.modules,
    "boto3_imported": "boto3" in sys.modules,
}))
"""


def in_new_process(tmp_path: Path, script: str, *args: str) -> dict:
    """Run `script` in a new process with an empty elastictrain cache; what it printed last, as JSON."""
    env = {**os.environ, "ELASTICTRAIN_CACHE": str(tmp_path / "cache"), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def structure_cached(tmp_path: Path) -> bool:
    """Written only when the cache was in place before transformers.models was first imported."""
    return bool(list((tmp_path / "cache").glob("transformers-*-import-structure.pkl")))


def test_a_workers_warm_up_defers_scipy_and_boto3_and_caches_the_import_structure(tmp_path: Path):
    seen = in_new_process(tmp_path, SCRIPT, str(REPO / "conf" / "tiny-cpu.yaml"))
    deferred = {"scipy_optimize_imported": False, "boto3_imported": False}
    assert seen == {"modeling_imported": True, **deferred}, seen
    assert structure_cached(tmp_path), "structure not cached"


# A driver or a command (export, eval, the memory estimate) that builds a model before anything else.
BUILD_SCRIPT = """
import json, sys
from elastictrain.model.build import build_causal_lm
build_causal_lm({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2})
print(json.dumps({
    "scipy_optimize_imported": "scipy.optimize" in sys.modules,
    "boto3_imported": "boto3" in sys.modules,
}))
"""


def test_a_process_whose_first_transformers_use_is_a_model_build_takes_the_same_cheap_way(tmp_path: Path):
    seen = in_new_process(tmp_path, BUILD_SCRIPT)
    assert seen == {"scipy_optimize_imported": False, "boto3_imported": False}, seen
    assert structure_cached(tmp_path), "structure not cached"
