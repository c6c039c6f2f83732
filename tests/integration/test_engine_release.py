"""A warm worker that leaves an attempt frees that attempt's DeepSpeed engine.

Recovery and resizes keep the surviving actors and build a new engine in each; ZeRO-3 kept every
engine it had built alive (a process-wide module stack and an lru_cache keyed by module), so a
survivor held one more model state per attempt (at 1B it ran the node out of memory beside a
replacement). Run in a child process: the worker initialises torch.distributed in its process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.integration

SCRIPT = """
import gc, json, sys
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from elastictrain.config import load_config
from elastictrain.control.specs import single_rank_spec
from elastictrain.worker.actor import TrainWorker

cfg = load_config(sys.argv[1], ["run.dir=" + sys.argv[2]])
worker = TrainWorker("w0", False, in_ray=False)  # as --local hosts it: no Ray cluster to start here
worker.warmup(cfg)
after = []
for attempt in range(3):
    worker.setup(single_rank_spec(cfg, checkpoint_dir=None, start_step=0))
    worker.train_step(0)
    worker.teardown()
    gc.collect()
    engines = sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())
    storages = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                for o in gc.get_objects() if torch.is_tensor(o)}
    after.append({"engines": engines, "tensor_bytes": sum(storages.values())})
print("RESULT " + json.dumps(after))
"""


def test_a_worker_leaving_attempts_keeps_none_of_their_engines(tmp_path):
    config = REPO / "conf" / "tiny-cpu.yaml"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(config), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    after = json.loads(line.removeprefix("RESULT "))
    assert [a["engines"] for a in after] == [0, 0, 0]
    # What stays once an attempt is left (data, buffers) does not grow with the attempts.
    assert after[-1]["tensor_bytes"] <= after[0]["tensor_bytes"] + 64 * 1024
