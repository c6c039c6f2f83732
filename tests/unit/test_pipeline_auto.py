"""`scaling.pipeline_parallel: auto`: the stages chosen by the cost model at each world size, and the
control loop taking the choice at every attempt (on the fake worker group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from loop_harness import make_run

from elastictrain.config import load_config
from elastictrain.core.layout import ModelShape
from elastictrain.core.memory_estimate import GIB
from elastictrain.core.parallel_layout import Hardware, stage_candidates
from elastictrain.driver.pipeline_auto import StageChooser, pipelines_allowed

# A 7B decoder's numbers (the choice reads only these).
SHAPE_7B = ModelShape(
    params=6_740_000_000,
    largest_layer=131_072_000,
    hidden=4096,
    intermediate=11008,
    kv_width=4096,
    layers=32,
    vocab=32000,
    zero3_live=10**9,
)
AUTO = ("scaling.pipeline_parallel=auto", "deepspeed.zero_stage=1")


def _chooser(memory_gib: float, *overrides: str) -> StageChooser:
    cfg = load_config(
        None,
        [
            *AUTO,
            "training.global_batch_size=64",
            "training.micro_batch_size=1",
            "data.seq_len=2048",
            "model.hf_config.max_position_embeddings=4096",
            *overrides,
        ],
    )
    # GPUs of `memory_gib`, 8 a node, a 100 Gb/s network.
    hw = Hardware(int(memory_gib * GIB), 4e14, 1.5e11, 1.25e10, 8, on_gpu=True)
    return StageChooser(cfg, SHAPE_7B, hw, pipelines_allowed(cfg))


def test_candidates_are_stage_counts_whose_replicas_split_the_batch():
    tiny = ModelShape(1000, 100, 64, 128, 64, 2, 256, 1000)
    assert [d.pipeline for d in stage_candidates(tiny, 4, 12, 1, pipelines=True)] == [1, 2, 4]
    deeper = ModelShape(1000, 100, 64, 128, 64, 4, 256, 1000)
    assert [d.pipeline for d in stage_candidates(deeper, 6, 4, 1, pipelines=True)] == [1, 3, 6]  # 4 % 3
    assert [d.pipeline for d in stage_candidates(tiny, 4, 12, 1, pipelines=False)] == [1]
    zero3 = stage_candidates(tiny, 4, 12, 3, pipelines=True)
    assert [(d.pipeline, d.zero_stage) for d in zero3] == [(1, 3), (2, 1), (4, 1)]
    # LoRA: every stage must hold a decoder layer's adapters, so at most the 2 layers.
    lora = ModelShape(1000, 100, 64, 128, 64, 2, 256, 1000, trainable=10)
    assert [d.pipeline for d in stage_candidates(lora, 4, 12, 1, pipelines=True)] == [1, 2]


def test_stages_and_tensor_parallelism_are_not_both_left_to_auto():
    from elastictrain.config import ConfigError, load_config

    both = ["scaling.pipeline_parallel=auto", "scaling.tensor_parallel=auto"]
    with pytest.raises(ConfigError, match="got 'auto' with scaling.tensor_parallel: auto"):
        load_config(None, [*both, "scaling.min_workers=4", "scaling.max_workers=4"])


def test_stages_are_chosen_where_one_rank_cannot_hold_its_share_and_again_at_another_size():
    chooser = _chooser(80)
    # At 8 ranks ZeRO-1 keeps 2 B/param of weights and gradients whole on every rank: 7B does not fit an
    # 80 GiB device without stages; at 64 ranks the optimizer's share is small enough that it may.
    p8, line8 = chooser.choose(8)
    assert p8 > 1, line8
    assert line8.startswith(
        f"scaling.pipeline_parallel=auto chose {p8} at 8 ranks: P {p8} x T 1 x D {8 // p8}"
    )
    assert "runner-up" in line8
    p2, _ = chooser.choose(2)
    assert p2 >= p8  # fewer ranks: each holds at least as much


def test_a_config_that_cannot_train_stages_stays_at_one_and_says_why():
    chooser = _chooser(80, "model.lora.enabled=true", "model.lora.use_dora=true")
    assert not chooser.pipelines
    stages, line = chooser.choose(8)
    assert stages == 1 and "no stages: the config trains without pipelines" in line


def test_the_control_loop_takes_the_stages_chosen_for_each_attempts_world_size(tmp_path: Path):
    class Chooser:  # two stages at 2 ranks, none at 3 (what the cost model says is its own test's)
        def choose(self, world_size: int) -> tuple[int, str]:
            p = 2 if world_size == 2 else 1
            return p, f"scaling.pipeline_parallel=auto chose {p} at {world_size} ranks"

    r = make_run(
        tmp_path,
        "scaling.min_workers=2",
        "scaling.max_workers=3",
        "scaling.pipeline_parallel=auto",
        "deepspeed.zero_stage=1",
        capacity=3,
        stages=Chooser(),
    )
    plans: list[tuple[int, int]] = []
    r.controller.callbacks.after_attempt_start.append(
        lambda c: plans.append((c.world_size, c.plan.pipeline_parallel))
    )
    r.group.die_at_step(rank=2, step=5)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    assert plans[:2] == [(3, 1), (2, 2)], plans
    moves = [(e["world_size"], e["pipeline_parallel"]) for e in r.events("pipeline_parallel")]
    assert moves[:2] == [(3, 1), (2, 2)], moves
