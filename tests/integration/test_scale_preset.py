"""Issue 14: correctness at size. The 30M preset (conf/llama-30m.yaml) trains on 2 workers, checkpoints,
reshards to 3 and continues; the state after the load equals the state saved, tensor by tensor, and the
two ways a rank writes its file (a host snapshot written in the background, or streamed from the live
state) give the same bytes. Streaming because a snapshot would not fit `checkpoint.max_host_memory_mb`
runs the same streaming code; test_background_checkpoint.py tests that choice and that write.

Also: a configuration whose ranks cannot fit the nodes' memory is refused before any worker starts.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray
from helpers import REPO
from probe import ProbeGroup, assert_same_state, save_checkpoint, train_steps

from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.config import load_config

pytestmark = pytest.mark.integration

# Two steps of the preset's model on a small batch: the sizes and the state are the preset's.
SMALL_BATCH = ["training.global_batch_size=6", "training.micro_batch_size=1", "data.generated_chars=100000"]


def _preset(tmp_path: Path, *extra: str):  # noqa: ANN202
    return load_config(
        REPO / "conf" / "llama-30m.yaml", [f"run.dir={tmp_path / 'run'}", *SMALL_BATCH, *extra]
    )


def _background_save(probes: ProbeGroup, root: Path, step: int) -> list[dict]:
    """Each rank's background save (`save_shard(..., background=True)`), waited for: their reports."""
    staging = CheckpointStore(root).begin(step)
    outs = ray.get([a.save_shard.remote(str(staging), True) for a in probes.active], timeout=600)
    reports = ray.get([a.save_status.remote(str(staging), 600.0) for a in probes.active], timeout=900)
    for out, report in zip(outs, reports, strict=True):
        assert report["state"] == "done", report
        out["file"] = report["file"]
    return outs


def test_the_30m_preset_reshards_2_to_3_tensor_for_tensor_and_both_save_paths_write_the_same_bytes(
    probes: ProbeGroup, tmp_path: Path
) -> None:
    cfg = _preset(tmp_path)
    params = sum(math.prod(s) for s in _shapes(cfg))
    assert 25e6 < params < 40e6, params  # the preset is the size its name says

    probes.setup(cfg, world_size=2)
    losses = train_steps(probes, range(2))
    saved = save_checkpoint(probes, cfg, tmp_path / "w2", 2)  # streamed: save_shard without background

    probes.setup(cfg, world_size=3, checkpoint_dir=str(saved), step=2)
    again = save_checkpoint(probes, cfg, tmp_path / "w3", 2)
    compared = assert_same_state(saved, again)
    assert compared[0] == "fp32" and len(compared) == 3  # fp32 weights and both Adam moments

    # The background path (a snapshot in host memory, written by a thread) writes the very same file.
    outs = _background_save(probes, tmp_path / "w3-background", 2)
    assert {o["mode"] for o in outs} == {"snapshot"}
    streamed = {
        f["name"]: f["sha256"] for f in CheckpointStore(tmp_path / "w3").latest_committed().manifest["files"]
    }
    assert {o["file"]["name"]: o["file"]["sha256"] for o in outs} == streamed

    more = train_steps(probes, range(2, 3))  # and training goes on at the new size
    assert all(math.isfinite(x) for x in losses + more), (losses, more)


def test_a_model_too_large_for_the_nodes_memory_is_refused_before_any_worker_starts(
    ray_local: None, tmp_path: Path
) -> None:
    from elastictrain.driver.preflight import PreflightError, check_memory_on_nodes

    # ~15B parameters, no offload: 20 bytes each, over 100 GB per rank at 2 ranks.
    big = _preset(tmp_path, "model.hf_config.hidden_size=8192", "model.hf_config.num_hidden_layers=16",
                  "model.hf_config.intermediate_size=28672", "model.hf_config.num_attention_heads=64",
                  "model.hf_config.num_key_value_heads=64")  # fmt: skip
    with pytest.raises(PreflightError, match=r"memory per rank.*fewer than scaling.min_workers=2.*nvme"):
        check_memory_on_nodes(big)
    fits = check_memory_on_nodes(_preset(tmp_path))
    assert fits is not None and 0.5e9 < fits.host_bytes < 2e9, fits


def _shapes(cfg) -> list[tuple[int, ...]]:  # noqa: ANN001
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(cfg.model.hf_config)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    return [tuple(p.shape) for p in model.parameters()]
