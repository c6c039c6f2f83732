"""Tensor parallelism (issue 40): replicas of AutoTP ranks compute what plain PyTorch computes.

TP 2 x DP 2 (four workers) under ZeRO-0 and 3 and TP 2 x DP 1 under ZeRO-2 report the single-process
reference loop's loss at every step (ZeRO-1 at TP 2 x DP 2 in the resume test's first six steps: it
shares ZeRO-2's optimizer and flat checkpoint layout, whose export the ZeRO-2 case checks), within the
tolerance derived in test_plain_pytorch_equivalence (10x the difference between two reference runs that
differ only in summation order). The checkpoint holds each projection as named slices, and `export`
joins them into a model whose logits are the reference model's.

Every test runs on three nodes of two CPUs (each holds one replica of 2), the nodes the last one needs to
remove one: on one cluster the module's runs hand their warm workers on (scaling.keep_warm_s) instead of
starting them again on a second cluster (8 workers started cold in the module instead of 14).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run
from reference import global_batch
from test_plain_pytorch_equivalence import STEPS, assert_same_losses, config, logged_losses, reference_for

from elastictrain.checkpoint.tensor_slices import parse
from elastictrain.data.sources import dataset_from_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("stage", "workers"),
    [(2, 2), (0, 4), (3, 4)],
    ids=["tp2xdp1-z2", "tp2xdp2-z0", "tp2xdp2-z3"],
)
def test_tensor_parallel_replicas_report_the_plain_pytorch_loss_and_export_the_reference_model(
    ray_cluster_two_cpu_nodes, tmp_path, stage, workers
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

    reference = reference_for(cfg)
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


def test_a_checkpoint_loads_at_another_tensor_parallel_size_and_the_run_continues_as_if_uninterrupted(
    ray_cluster_two_cpu_nodes, tmp_path
):
    """TP 2 x DP 2 stopped after step 6 (checkpoint at 4) continues at TP 1 x DP 3, stopped after step
    10 (checkpoint at 8) continues at TP 2 x DP 1: every step's loss is the plain PyTorch loop's."""
    from helpers import at_step

    def stop(controller: object) -> None:
        raise KeyboardInterrupt

    steps = 12
    common = ["deepspeed.zero_stage=1", f"training.max_steps={steps}", "checkpoint.every_steps=4"]

    def layout(tp: int, workers: int) -> object:
        scaling = [f"scaling.tensor_parallel={tp}", f"scaling.min_workers={workers}"]
        return config(tmp_path / "run", False, *common, *scaling, f"scaling.max_workers={workers}")

    from elastictrain.driver.launch import apply_resume_changes
    from elastictrain.rundir.run_dir import RunDir

    def resumed_as(cfg: object) -> object:  # what `elastictrain resume RUN_DIR scaling...` does first
        apply_resume_changes(RunDir.open(tmp_path / "run"), cfg)
        return cfg

    with pytest.raises(KeyboardInterrupt):
        run(layout(2, 4), hook=at_step(6, stop))
    with pytest.raises(KeyboardInterrupt):
        run(resumed_as(layout(1, 3)), hook=at_step(10, stop))
    cfg = resumed_as(layout(2, 2))
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    resumed = [e for e in run_dir.read_events() if e["event"] == "resume"]
    assert [e["tag"] for e in resumed] == ["step-000004", "step-000008"], resumed
    starts = [(e["world_size"], e["step"]) for e in run_dir.read_events() if e["event"] == "attempt_started"]
    assert starts == [(4, 0), (3, 4), (2, 8)], starts
    reference = reference_for(cfg)
    what = "TP 2 x DP 2, then TP 1 x DP 3 from its checkpoint, then TP 2 x DP 1 from that one's"
    assert_same_losses(logged_losses(run_dir), reference.losses[:steps], reference.loss_tol, what)

    # verify and reshard read the last checkpoint (TP 2 slices) as any other: whole parameters at world 3.
    from typer.testing import CliRunner

    from elastictrain.checkpoint.zero_state import FragmentReader
    from elastictrain.cli import app

    last = run_dir.checkpoints_dir / f"step-{steps:06d}"
    verified = CliRunner().invoke(app, ["verify", str(last)])
    assert verified.exit_code == 0 and "every file matches its manifest" in verified.output, verified.output
    out = tmp_path / "resharded"
    resharded = CliRunner().invoke(app, ["reshard", str(last), "--world-size", "3", "--out", str(out)])
    assert resharded.exit_code == 0, resharded.output
    before, after = (
        FragmentReader(sorted(last.glob("*.safetensors"))),
        FragmentReader(sorted(out.glob("*.safetensors"))),
    )
    assert sorted(after.params) == sorted(before.params) and any("q_proj" in n for n in before.params)
    for name in before.params:
        assert torch.equal(after.full(name), before.full(name)), name


def test_auto_chooses_two_for_a_model_whose_ranks_do_not_fit_the_node_at_one(
    ray_cluster_two_cpu_nodes, tmp_path
):
    """A model sized from this machine's memory so that a node's two whole-model ranks do not fit it and
    two TP-2 ranks do (built on the meta device only: nothing is trained or allocated). Six ranks on the
    three two-CPU nodes: two on each, as at one node of two."""
    from elastictrain.driver.preflight import memory_estimate
    from elastictrain.driver.tensor_parallel_auto import choose_tensor_parallel
    from elastictrain.host.memory import meminfo_bytes

    total = meminfo_bytes("MemTotal")
    assert total

    def sized(layers: int, degree: object) -> object:
        return config(
            tmp_path / "run",
            False,
            "model.hf_config.hidden_size=1024",
            "model.hf_config.intermediate_size=4096",
            "model.hf_config.num_attention_heads=8",
            "model.hf_config.num_key_value_heads=8",
            f"model.hf_config.num_hidden_layers={layers}",
            "deepspeed.zero_stage=0",
            "scaling.min_workers=6",
            "scaling.max_workers=6",
            f"scaling.tensor_parallel={degree}",
        )

    def need(layers: int, degree: int) -> int:
        return 2 * memory_estimate(sized(layers, degree), 6).host_need

    layers = next(n for n in range(1, 4096) if need(n, 1) > total)
    assert need(layers, 2) <= total, "the machine's memory leaves no model between the two sizes"
    cfg = sized(layers, "auto")
    said, _ = choose_tensor_parallel(cfg)
    assert cfg.scaling.tensor_parallel == 2, said
    assert said == (
        "scaling.tensor_parallel=auto chose 2: the smallest degree whose memory estimate fits the nodes; "
        "1 would not fit"
    )


def test_under_auto_each_restart_takes_the_degree_that_fits_its_world_size_from_memory(
    ray_cluster_two_cpu_nodes, tmp_path
):
    """`auto` chooses degree 1 for the tiny model at the start. Then the memory verdict the run reads
    is replaced (the only thing injected: a machine whose memory holds degree 1 only at 4 ranks) and a
    worker is killed: the restart at 3 ranks would not fit at degree 1, so the run goes on at one
    replica of 2 from the in-memory snapshots of degree 1, and once a replacement is warm grows back to
    4 ranks, where degree 1 fits again, from the snapshots of degree 2. Every loss is the plain PyTorch
    loop's."""
    from typing import Any

    import ray
    from helpers import at_step, chain, wait_until_replacements_are_warm

    steps = 12

    def tight_memory(controller: Any) -> None:
        controller.capacity.degrees.fits = lambda n, world: n > 1 or world >= 4

    def kill_a_worker(controller: Any) -> None:
        ray.kill(controller.active[3].actor)

    cfg = config(
        tmp_path / "run",
        False,
        "deepspeed.zero_stage=1",
        "scaling.tensor_parallel=auto",
        "scaling.min_workers=2",
        "scaling.max_workers=4",
        f"training.max_steps={steps}",
        "checkpoint.every_steps=4",
        "checkpoint.memory_max_step_share=0",  # a snapshot every step, whatever it costs here
    )
    hook = chain(tight_memory, at_step(5, kill_a_worker), at_step(6, wait_until_replacements_are_warm))
    summary, run_dir, output = run(cfg, hook=hook)
    assert summary.status.value == "FINISHED", output
    assert "scaling.tensor_parallel=auto chose 1" in output
    starts = [e for e in run_dir.read_events() if e["event"] == "attempt_started"]
    assert [(s["world_size"], s["source"]) for s in starts] == [(4, "none"), (2, "memory"), (4, "memory")]
    assert "world size 2 (micro batch 2 x accumulation 6 x 1 replica(s) of 2 tensor-parallel ranks" in output
    # Back at 4 ranks degree 1 fits again: the grow returns to it, from the snapshots of degree 2.
    chosen = [e for e in run_dir.read_events() if e["event"] == "tensor_parallel"]
    assert [e["tensor_parallel"] for e in chosen] == [2, 1], chosen
    assert "1 at 3 ranks would not fit" in chosen[0]["message"]
    reference = reference_for(cfg)
    what = "auto: TP 1 x DP 4, TP 2 x DP 1 from memory, TP 1 x DP 4 from memory"
    assert_same_losses(logged_losses(run_dir), reference.losses[:steps], reference.loss_tol, what)


def test_a_replica_losing_a_rank_or_its_node_leaves_the_run_to_the_others_from_memory_and_a_replica_rejoins(
    ray_cluster_two_cpu_nodes, tmp_path
):
    from replica_loss import STEPS, ReplicaLoss

    scenario = ReplicaLoss(ray_cluster_two_cpu_nodes, killed=2)  # the second replica's first rank
    cfg, run_dir, _ = scenario.run(tmp_path / "run", "scaling.tensor_parallel=2")
    # Through the shrinks and the grows, every step's loss is the plain PyTorch loop's (the schedule of
    # this run's 14 steps: the reference's first 14).
    reference = reference_for(cfg)
    what = "TP 2: DP 2, 1 after a rank's loss, 2 again, 1 after a node's loss, 2 again"
    assert_same_losses(logged_losses(run_dir), reference.losses[:STEPS], reference.loss_tol, what)
