"""Pipeline replicas on three nodes of two slots (tests/integration/conftest.py's
`ray_cluster_two_cpu_nodes`): a replica losing a stage or its node, and a replica of more stages than a
node holds. tests/conftest.py runs this file right after test_tensor_parallel.py on the same xdist
worker, so it takes over that module's cluster and warm workers instead of starting its own.

Real Ray workers hosting DeepSpeed's pipeline engine over gloo; the reference is
test_plain_pytorch_equivalence.py's single-process loop with its derived tolerances.
"""

from __future__ import annotations

import pytest
from helpers import run
from test_plain_pytorch_equivalence import assert_same_losses, config, logged_losses, reference_for

pytestmark = pytest.mark.integration


def test_a_pipeline_replica_losing_a_stage_or_its_node_leaves_the_run_to_the_other_and_one_rejoins(
    ray_cluster_two_cpu_nodes, tmp_path
):
    """P 2 x D 2 on nodes of two slots (a replica's stages on one node): a killed stage takes its replica
    out and the other trains on from memory; a replacement rejoins; then a node goes, with the same
    outcome. The sample ledger and every step's loss are the plain loop's."""
    from replica_loss import STEPS, ReplicaLoss

    scenario = ReplicaLoss(ray_cluster_two_cpu_nodes, killed=3)  # the second replica's last stage
    cfg, run_dir, output = scenario.run(tmp_path / "run", "scaling.pipeline_parallel=2")
    assert "replica(s) of 2 pipeline stages" in output
    reference = reference_for(cfg)
    what = "P 2: D 2, 1 after a stage's loss, 2 again, 1 after a node's loss, 2 again"
    assert_same_losses(logged_losses(run_dir), reference.losses[:STEPS], reference.loss_tol, what)


def test_a_replica_of_more_stages_than_a_node_holds_spans_two_nodes_and_says_so(
    ray_cluster_two_cpu_nodes, tmp_path
):
    """P 3 on nodes of two slots: no node holds a replica, so its stages take as few nodes as they can
    (two) and the attempt says so; it trains the plain loop's losses."""
    steps = 6
    cfg = config(
        tmp_path / "run",
        False,
        "deepspeed.zero_stage=0",
        "scaling.pipeline_parallel=3",
        "scaling.min_workers=3",
        "scaling.max_workers=3",
        f"training.max_steps={steps}",
    )
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    (started,) = [e for e in run_dir.read_events() if e["event"] == "attempt_started"]
    assert started["replica_nodes"] == [2], started
    assert "1 replica(s) of 3 pipeline stages" in output and "each replica's stages on 2 node(s)" in output
    reference = reference_for(cfg)
    assert_same_losses(logged_losses(run_dir), reference.losses[:steps], reference.loss_tol, "P 3 on 2 nodes")
