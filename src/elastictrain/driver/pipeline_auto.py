"""`scaling.pipeline_parallel: auto` on the driver: how many pipeline stages, chosen per world size.

At the start the choice is made for scaling.min_workers ranks and printed with the runner-up and their
estimated step times; before every attempt the control loop asks again for the attempt's world size
(`StageChooser.choose`), so a shrink or a grow may change the number of stages (checkpoints and
in-memory snapshots load at any layout: parameters are saved by their transformers names). The cost
model is pure (core/parallel_layout.py: compute, the 1F1B bubble, stage boundaries, data-parallel
gradients, memory per rank); this module reads what it needs: each rank's memory on the worker nodes,
their ranks, and the decoder's shape. Stages of a replica may then sit on different nodes (the cost model
counts their traffic over the network), so workers are reserved one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.config.pipeline_check import pipeline_problems
from elastictrain.core.layout import ModelShape
from elastictrain.core.parallel_layout import (
    Batch,
    Hardware,
    assumed_hardware,
    estimate,
    pick,
    stage_candidates,
)

AUTO = "auto"


def pipelines_allowed(config: Any) -> bool:
    """Whether the config could train with pipeline stages at all (nothing pipeline_problems refuses,
    beside whole replicas: auto picks only stage counts that divide the world)."""
    import copy

    trial = copy.copy(config)
    trial.scaling = copy.copy(config.scaling)
    trial.scaling.pipeline_parallel = 2
    trial.scaling.min_workers = trial.scaling.max_workers = 2
    trial.scaling.spare_workers = 0
    return not pipeline_problems(trial)


@dataclass
class StageChooser:
    config: Any
    shape: ModelShape
    hardware: Hardware
    pipelines: bool  # whether the config allows more than one stage

    def choose(self, world_size: int) -> tuple[int, str]:
        """The stages at `world_size` ranks, and the line saying why (the choice and the runner-up)."""
        t = self.config.training
        batch = Batch(t.global_batch_size, self.config.data.seq_len, int(t.micro_batch_size), t.precision)
        stage = int(self.config.deepspeed.zero_stage)
        degrees = stage_candidates(
            self.shape, world_size, t.global_batch_size, stage, pipelines=self.pipelines
        )
        best, runner_up = pick([estimate(self.shape, d, self.hardware, batch) for d in degrees])
        why = f"at {world_size} ranks: {best.describe()}"
        if runner_up is not None:
            why += f"; runner-up {runner_up.describe()}"
        elif not self.pipelines:
            why += "; no stages: the config trains without pipelines (scaling.pipeline_parallel's limits)"
        return best.degrees.pipeline, f"scaling.pipeline_parallel=auto chose {best.degrees.pipeline} {why}"


def choose_at_start(config: Any) -> tuple[str, StageChooser]:
    """The chooser, from the worker nodes' memory and ranks (this machine's where none answers), and its
    line for scaling.min_workers ranks."""
    from elastictrain.cluster.nodes import worker_nodes
    from elastictrain.driver.layout_auto import model_shape, rank_memory, rank_memory_here
    from elastictrain.driver.preflight import node_slots

    memory = rank_memory(config) or rank_memory_here(config)  # one probe of each node
    use_gpu = bool(config.scaling.use_gpu)
    per_rank = (memory.device if use_gpu else memory.host) if memory is not None else 1 << 40
    # A node's ranks are its resources' (what Ray reports), no probe needed.
    ranks = max((node_slots(n.get("Resources", {}), config) for n in worker_nodes(config)), default=1) or 1
    hardware = assumed_hardware(int(per_rank), ranks, on_gpu=use_gpu)
    chooser = StageChooser(config, model_shape(config), hardware, pipelines_allowed(config))
    _, line = chooser.choose(int(config.scaling.min_workers))
    return line, chooser
