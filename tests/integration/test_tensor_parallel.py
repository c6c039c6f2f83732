"""Tensor parallelism (issue 40): replicas of AutoTP ranks compute what plain PyTorch computes.

TP 2 x DP 2 (four workers) under ZeRO-1 and TP 2 x DP 1 under ZeRO-2 report the single-process
reference loop's loss at every step, within the tolerance derived in test_plain_pytorch_equivalence
(10x the difference between two reference runs that differ only in summation order). The checkpoint
holds each projection as named slices, and `export` joins them into a model whose logits are the
reference model's.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run
from reference import global_batch
from test_plain_pytorch_equivalence import STEPS, Reference, assert_same_losses, config, logged_losses

from elastictrain.checkpoint.tensor_slices import parse
from elastictrain.data.sources import dataset_from_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("stage", "workers"), [(1, 4), (2, 2)], ids=["tp2xdp2-z1", "tp2xdp1-z2"])
def test_tensor_parallel_replicas_report_the_plain_pytorch_loss_and_export_the_reference_model(
    ray_local, tmp_path, stage, workers
):
    cfg = config(
        tmp_path / "run",
        False,
        f"deepspeed.zero_stage={stage}",
        "scaling.tensor_parallel=2",
        f"scaling.min_workers={workers}",
        f"scaling.max_workers={workers}",
    )
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    assert f"{workers // 2} replica(s) of 2 tensor-parallel ranks" in output

    reference = Reference(cfg)
    what = f"TP 2 x DP {workers // 2}, ZeRO-{stage}"
    assert_same_losses(logged_losses(run_dir), reference.losses, reference.loss_tol, what)

    latest = run_dir.checkpoints_dir / f"step-{STEPS:06d}"
    manifest = json.loads((latest / "manifest.json").read_text())
    from safetensors import safe_open

    saved = set()
    for f in manifest["files"]:
        if f["name"].endswith(".safetensors"):
            with safe_open(str(latest / f["name"]), "pt") as handle:
                saved |= {key.rpartition("::")[0] for key in handle.keys()}  # noqa: SIM118
    sliced = {parse(name)[1] for name in saved if "q_proj" in name}
    assert {(s.index, s.count, s.dim) for s in sliced if s} == {(0, 2, 0), (1, 2, 0)}, sorted(saved)[:6]

    from typer.testing import CliRunner

    from elastictrain.cli import app

    result = CliRunner().invoke(app, ["export", str(run_dir.path), "--out", str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True).eval()
    ids = global_batch(cfg, dataset_from_config(cfg), STEPS)[:4]
    want, logits_tol = reference.logits_and_tolerance(ids)
    with torch.no_grad():
        diff = (exported(input_ids=ids).logits - want).abs().max().item()
    assert diff <= logits_tol, f"export vs reference after {STEPS} steps: {diff:.2e} > {logits_tol:.2e}"
