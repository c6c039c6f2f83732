"""Auto layout fields resolved on a real Ray cluster: each worker node's memory read where it runs (a probe
per node), the choice made for scaling.min_workers and printed as the start prints it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_config

pytestmark = pytest.mark.integration

AUTO = (
    "deepspeed.zero_stage=auto",
    "training.micro_batch_size=auto",
    "deepspeed.activation_checkpointing=auto",
)


def test_the_nodes_memory_decides_the_layout_chosen_at_the_start(ray_local: None, tmp_path: Path) -> None:
    from elastictrain.driver.layout_auto import choose_at_start, rank_memory
    from elastictrain.host.memory import meminfo_bytes

    cfg = tiny_config(tmp_path / "run", *AUTO, "scaling.min_workers=2", "scaling.max_workers=2")
    memory = rank_memory(cfg)
    assert memory is not None and memory.device == 0  # no GPU asked for: the host is the rank's memory
    # This machine is the cluster's one node: its memory shared by the ranks it holds (2 CPUs, 1 each).
    assert memory.host == meminfo_bytes("MemTotal") // 2
    choice, chooser = choose_at_start(cfg, memory)
    lines = choice.lines()
    assert lines[0] == (
        "layout (auto) at world size 2: ZeRO-0, no offload, no activation checkpointing, micro batch 6"
    )
    assert "usable on the host" in lines[1]
    assert (cfg.deepspeed.zero_stage, cfg.training.micro_batch_size) == (0, 6)  # set for every later reader
    assert chooser.choose(1).layout.micro_batch_size == 12  # asked again at another world size
