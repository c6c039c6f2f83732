"""A worker's transformers import leaves SciPy's optimizer out, and the loss that uses it still gets SciPy's
answer (compat/transformers/scipy_deferred.py)."""

from __future__ import annotations

import json
import subprocess
import sys

# In a new process (nothing of transformers or SciPy imported yet), as model/build.py imports.
SCRIPT = """
import json, sys
from elastictrain.compat.transformers.scipy_deferred import import_losses_without_scipy
import_losses_without_scipy()
import transformers.modeling_utils
from transformers import LlamaForCausalLM
before = sorted(k for k in sys.modules if k.split(".")[0] == "scipy")
import numpy as np
from transformers.loss import loss_for_object_detection as losses
rows, cols = losses.linear_sum_assignment(np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]]))
import scipy.optimize
print(json.dumps({
    "before": before,
    "rows": rows.tolist(), "cols": cols.tolist(),
    "real_afterwards": scipy.optimize.__name__ == "scipy.optimize" and hasattr(scipy.optimize, "minimize"),
    "llama": LlamaForCausalLM.__name__,
}))
"""


def test_transformers_losses_import_without_scipy_and_the_matcher_still_gets_scipys_answer():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["before"] == [], got["before"][:10]  # not one SciPy module while the model code imports
    # The minimum-cost assignment of that matrix (1 + 2 + 2): SciPy's, imported at the call.
    assert (got["rows"], got["cols"]) == ([0, 1, 2], [1, 0, 2])
    assert got["real_afterwards"] and got["llama"] == "LlamaForCausalLM"
