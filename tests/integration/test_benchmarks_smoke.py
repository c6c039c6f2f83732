"""The benchmark harness runs every benchmark at its smallest size and writes well-formed results.

Real peers (the deepspeed launcher, torchrun, Ray Train's TorchTrainer) and real elastictrain runs;
no time is asserted, only that each result holds the figures the table needs, as finite numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

EXPECTED: dict[str, list[str]] = {
    "throughput": [
        "ws2.samples_per_s.elastictrain",
        "ws2.samples_per_s.deepspeed",
        "ws2.elastictrain_vs_deepspeed",
    ],
    "checkpoint_stall": [
        "elastictrain_checkpoint_s",
        "deepspeed_save_checkpoint_s",
        "elastictrain_snapshot_s",
        "stall_ratio",
    ],
    "memory": [
        "parameters",
        "model_state_bytes_per_rank",
        "deepspeed_peak_rss_bytes",
        "elastictrain_none_peak_rss_bytes",
    ],
    "reshard": [
        "universal_route_s",
        "ds_to_universal_s",
        "universal_load_s",
        "elastictrain_load_s",
        "elastictrain_offline_reshard_s",
        "speedup_vs_universal",
        "disk_write_fsync_bytes_per_s",
        "disk_read_bytes_per_s",
        "max_loss_difference",
    ],
    "recovery": [
        "worker_killed.elastictrain.death_to_first_step_s",
        "worker_killed.elastictrain.steps_lost",
    ],
    "memory_recovery": [  # the smoke skips the run without snapshots and the disk recovery
        "steps_lost.elastictrain_memory",
        "death_to_first_step_s.elastictrain_memory",
        "copy_cpu_cost",
        "step_cost_interleaved",
        "held_bytes_per_rank",
        "transport.socket_s",
        "transport.actor_call_s",
    ],
    "warm_rerun": ["warm_first_step_s", "new_first_step_s", "warm_vs_new_first_step", "new_machine_cpu_s"],
    "controller_scale": [
        "64.healthy_iteration_s",
        "64.dead_iteration_s",
        "64.hang_iteration_s",
        "64.death_detection_latency_s",
    ],
}


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        assert isinstance(d, dict) and part in d, f"missing {dotted!r} (at {part!r}) in {sorted(d)}"
        d = d[part]
    return d


@pytest.mark.timeout(900)
def test_every_benchmark_at_smoke_size(tmp_path: Path) -> None:
    results = tmp_path / "results"
    markdown = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--results",
            str(results),
            "--markdown",
            str(markdown),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, f"benchmarks.run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    for name, keys in EXPECTED.items():
        data = json.loads((results / f"{name}.json").read_text())
        assert data["benchmark"] == name and data["smoke"] is True and data["repetitions"] >= 1
        assert data["machine"]["cpus"] >= 1 and data["versions"]["deepspeed"] and data["versions"]["ray"]
        for key in keys:
            value = _get(data["metrics"], key)
            assert isinstance(value, int | float) and math.isfinite(value), f"{name}: {key} = {value!r}"
        for target in data["targets"]:
            assert {"name", "value", "target", "direction", "met", "missed_by"} <= set(target)
        assert (results / f"{name}.png").stat().st_size > 0

    # The resharded states agree: each load gives the saved state's loss on the same batch.
    reshard = json.loads((results / "reshard.json").read_text())["metrics"]
    assert reshard["max_loss_difference"] < 1e-3
    # Ray Train ran for real and its outcome after the kill is reported.
    recovery = json.loads((results / "recovery.json").read_text())
    ray_row = next(r for r in recovery["runs"] if r["system"] == "ray_train")
    assert ray_row["outcome"]
    assert ray_row["kill_step"] is not None
    text = markdown.read_text()
    assert "| Benchmark | Figure | Measured | Target | Status |" in text
    assert "Repetitions:" in text and "Versions:" in text and "Machine:" in text


def _smoke_only(name: str, tmp_path: Path, timeout: float) -> Path:
    """Run one opt-in benchmark at its smoke size; the folder its results went to."""
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--only", name, "--results", str(results),
         "--markdown", str(tmp_path / "BENCHMARKS.md")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"benchmarks.run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return results


@pytest.mark.timeout(420)
def test_sft_benchmark_at_smoke_size(tmp_path: Path) -> None:
    """The opt-in sft benchmark (elastictrain's `data.source: sft` against Hugging Face's Trainer under
    torchrun), on its own: 1-2 minutes on 2 cores, too long to add to the run above."""
    results = _smoke_only("sft", tmp_path, timeout=400)
    data = json.loads((results / "sft.json").read_text())
    assert data["benchmark"] == "sft" and data["smoke"] is True
    for key in ("samples_per_s", "real_tokens_per_s"):
        for system in ("elastictrain", "hf_trainer"):
            value = _get(data["metrics"], f"ws2.{key}.{system}")
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, system, value)
    # Both trained every record once, in the same micro-batches: the same epoch, step for step.
    assert data["metrics"]["trainer_same_batches"] is True
    from benchmarks.sft import SMOKE

    assert {r["steps"] for r in data["runs"]} == {SMOKE.steps}
    assert (results / "sft.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_memory_presets_benchmark_at_smoke_size(tmp_path: Path) -> None:
    """The opt-in memory_presets benchmark on the smallest workload: a kill at default settings and a run
    with a snapshot every other step, their figures finite (about 30 s on 2 cores)."""
    results = _smoke_only("memory_presets", tmp_path, timeout=280)
    data = json.loads((results / "memory_presets.json").read_text())
    assert data["benchmark"] == "memory_presets" and data["smoke"] is True
    for key in ("steps_lost", "step_cost_interleaved", "step_s_without", "copy_s", "replicate_s"):
        value = _get(data["metrics"], f"smoke.{key}")
        assert isinstance(value, int | float) and math.isfinite(value), (key, value)
    assert data["metrics"]["smoke"]["recovered_from"] == ["memory"]
    assert (results / "memory_presets.png").stat().st_size > 0


@pytest.mark.timeout(420)
def test_dpo_benchmark_at_smoke_size(tmp_path: Path) -> None:
    """The opt-in dpo benchmark (elastictrain's `training.objective: dpo` against TRL's DPOTrainer under
    torchrun, LoRA and full fine-tune), on its own: about 2 minutes on 2 cores. TRL is installed beside the
    environment (.bench-peers/trl) when missing; where it cannot be, the result says so and this skips."""
    results = _smoke_only("dpo", tmp_path, timeout=400)
    data = json.loads((results / "dpo.json").read_text())
    assert data["benchmark"] == "dpo" and data["smoke"] is True
    if "trl_unavailable" in data["metrics"]:
        pytest.skip(f"TRL unavailable: {data['metrics']['trl_unavailable']}")
    for mode in ("lora", "full"):
        for key in ("pairs_per_s", "final_loss"):
            for system in ("elastictrain", "trl"):
                value = _get(data["metrics"], f"{mode}.ws2.{key}.{system}")
                assert isinstance(value, float) and math.isfinite(value) and value > 0, (mode, key, system)
        # The same pairs, model and optimizer: the two systems' losses agree step for step.
        assert data["metrics"][mode]["ws2"]["max_loss_difference"] < 1e-3
    # Both trained every pair once, in the same micro-batches: the same epoch, step for step.
    assert data["metrics"]["trl_same_batches"] is True
    from benchmarks.dpo import SMOKE

    assert {r["steps"] for r in data["runs"]} == {SMOKE.steps}
    full = [r for r in data["runs"] if r["mode"] == "full"]
    assert all(r["ref_s"] > 0 for r in full)  # each system's reference pass, timed beside the epoch
    assert (results / "dpo.png").stat().st_size > 0


@pytest.mark.timeout(420)
def test_straggler_benchmark_at_smoke_size(tmp_path: Path) -> None:
    """The opt-in straggler benchmark (one rank of 3 slowed, kept or replaced) alone: about 2 minutes."""
    results = _smoke_only("straggler", tmp_path, timeout=400)
    data = json.loads((results / "straggler.json").read_text())
    (run,) = data["runs"]
    assert run["kept"]["named_after_steps"] is not None and run["replaced"]["named_after_steps"] is not None
    assert run["fault_free"]["named_after_steps"] is None  # nobody named without a slowed rank
    assert min(ws for _, _, ws in run["replaced"]["steps"]) == 2  # the straggler left the run
    for name in ("fault_free", "kept", "replaced"):
        assert run[name]["tail_samples_per_s"] > 0
    assert (results / "straggler.png").stat().st_size > 0
