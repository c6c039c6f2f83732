"""A worker's transformers import leaves SciPy's optimizer and boto3 out, and what uses them still gets
the real modules (compat/transformers/deferred_imports.py)."""

from __future__ import annotations

import json
import subprocess
import sys

# In a new process (nothing of transformers, SciPy or boto3 imported yet), as model/build.py imports.
SCRIPT = """
import json, sys
from elastictrain.compat.transformers.deferred_imports import import_losses_deferring_unused
import_losses_deferring_unused()
import transformers.modeling_utils
from transformers import LlamaForCausalLM
before = sorted(k for k in sys.modules if k.split(".")[0] in ("scipy", "boto3", "botocore"))
import numpy as np
from transformers.loss import loss_for_object_detection as losses
rows, cols = losses.linear_sum_assignment(np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]]))
import scipy.optimize
from accelerate.commands.config import sagemaker
session = sagemaker.boto3.Session  # accelerate's name for boto3: the real module from here on
import boto3
print(json.dumps({
    "before": before,
    "rows": rows.tolist(), "cols": cols.tolist(),
    "real_afterwards": scipy.optimize.__name__ == "scipy.optimize" and hasattr(scipy.optimize, "minimize"),
    "boto3_real": session is boto3.Session and type(boto3).__name__ == "module" and "botocore" in sys.modules,
    "llama": LlamaForCausalLM.__name__,
}))
"""


def test_transformers_losses_import_without_scipy_or_boto3_and_their_users_still_get_the_real_modules():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["before"] == [], got["before"][:10]  # not one of their modules while the model code imports
    # The minimum-cost assignment of that matrix (1 + 2 + 2): SciPy's, imported at the call.
    assert (got["rows"], got["cols"]) == ([0, 1, 2], [1, 0, 2])
    assert got["real_afterwards"] and got["boto3_real"] and got["llama"] == "LlamaForCausalLM"
