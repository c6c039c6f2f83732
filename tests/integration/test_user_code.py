"""Issue 7: your own model, dataset and loss keep the elastic guarantees.

The elastic test runs the plain nn.Module example (named by import paths in its config, with a loss
closure handed to elastictrain.fit by value) on a 3-node Ray cluster through a node loss (shrink to 2)
and the node's return (grow to 3), and checks the sample ledger as tests/integration/test_memory_recovery.py
does for the built-in model. The examples themselves run as their READMEs say, in one process, on Ray
and from Python, and what each README promises is checked there (tests/integration/test_readme_commands.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, at_step, chain, quiet_reporter, wait_until_replacements_are_warm

from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.core.batch import plan_batch
from elastictrain.core.data_order import micro_batch_samples

pytestmark = pytest.mark.integration

EXAMPLES = REPO / "examples"
PLAIN = EXAMPLES / "plain_module"
NUM_SAMPLES = 240


def plain_overrides(run_dir: Path, *more: str) -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"data.args.size={NUM_SAMPLES}",
        "training.global_batch_size=12",
        "training.micro_batch_size=2",
        "training.max_steps=16",
        "checkpoint.every_steps=4",
        "failure.hang_timeout_s=60",
        "failure.collective_timeout_s=60",
        "failure.wait_for_capacity_s=20",
        *more,
    ]


def test_user_model_and_dataset_shrink_and_grow_with_an_exact_sample_ledger(
    ray_cluster, tmp_path, monkeypatch
):
    from elastictrain import fit

    # The driver imports the example's package from here; workers find it through PYTHONPATH, which
    # the driver extends with the folders user modules came from (restored after the test).
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", "")
    records: list[tuple[int, int, list[int]]] = []

    def ledger(controller: Any) -> None:
        controller.ledger = lambda step, rank, ids, _skipped=False: records.append((step, rank, list(ids)))

    def remove_a_worker_node(controller: Any) -> None:
        node_id = controller.active[-1].node_id
        ray_cluster.remove_node(next(n for n in ray_cluster.worker_nodes if n.node_id == node_id))

    def add_node_back(controller: Any) -> None:
        ray_cluster.add_node(num_cpus=1)
        wait_until_replacements_are_warm(controller)  # so the grow happens at the next checkpoint

    scale = 1.0  # captured by the closure below: a loss that is not importable travels by value

    def loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return scale * torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])

    overrides = plain_overrides(tmp_path / "run", "scaling.min_workers=2", "scaling.max_workers=3")
    summary = fit(
        PLAIN / "config.yaml",
        overrides,
        loss=loss,
        tracking=False,
        reporter=quiet_reporter(16),
        controller_hook=chain(ledger, at_step(6, remove_a_worker_node), at_step(9, add_node_back)),
    )
    assert summary.status.value == "FINISHED", summary.message
    run_dir = tmp_path / "run"
    info = json.loads((run_dir / "run.json").read_text())
    assert [h["world_size"] for h in info["world_size_history"]] == [3, 2, 3]
    assert [h["reason"] for h in info["world_size_history"]] == ["start", "shrink", "grow"]
    config_yaml = (run_dir / "config.yaml").read_text()
    assert "factory: plain_module.model:build_model" in config_yaml
    assert "loss: <test_user_code.test_user_model_and_dataset_shrink_and_grow" in config_yaml

    # The last record of each step counts (steps redone after the failure overwrite earlier ones).
    final: dict[tuple[int, int], list[int]] = {}
    sizes: dict[int, int] = {}
    for step, rank, ids in records:
        if rank == 0:
            for key in [k for k in final if k[0] == step]:
                del final[key]
        final[(step, rank)] = ids
        sizes[step] = max(sizes.get(step, 0), rank + 1)
    consumed = [i for _, ids in sorted(final.items()) for i in ids]
    assert len(consumed) == len(set(consumed)) == 16 * 12  # every sample at most once, none skipped
    assert {sizes[s] for s in range(16)} == {2, 3}
    for step in range(16):
        plan = plan_batch(12, 2, sizes[step])
        assert plan is not None
        want = sorted(
            i
            for r in range(sizes[step])
            for k in range(plan.grad_accum_steps)
            for i in micro_batch_samples(step, plan, r, k, num_samples=NUM_SAMPLES, seed=42)
        )
        assert sorted(i for (s, _), ids in final.items() if s == step for i in ids) == want, step

    # The user model trained: its last checkpoint holds every parameter of the MLP, moved since step 4.
    last = FragmentReader(sorted((run_dir / "checkpoints" / "step-000016").glob("*.safetensors")))
    assert set(last.params) == {
        "net.0.weight",
        "net.0.bias",
        "net.2.weight",
        "net.2.bias",
        "head.weight",
        "head.bias",
    }
