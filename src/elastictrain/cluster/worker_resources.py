"""What each worker process is given: its bundle of CPUs and GPUs, and its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

from elastictrain.cluster.allocator import allocator_env


@dataclass(frozen=True)
class WorkerResources:
    use_gpu: bool
    cpus_per_worker: float
    gpus_per_worker: float
    allocator: str = "system"  # scaling.worker_allocator
    # scaling.tensor_parallel x scaling.pipeline_parallel: a replica's ranks, reserved together
    ranks_per_reservation: int = 1
    # A pipeline replica's stages may span nodes (as few as Ray can: PACK); else its ranks share one
    replica_spans_nodes: bool = False

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            b["GPU"] = self.gpus_per_worker
        return b

    def env_vars(self) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": str(max(1, int(self.cpus_per_worker)))}
        if not self.use_gpu:
            env["DS_ACCELERATOR"] = "cpu"
        # Pass through what a worker needs to find the same package and loopback settings as the driver.
        for key in ("PYTHONPATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "TORCH_EXTENSIONS_DIR"):
            if key in os.environ:
                env[key] = os.environ[key]
        # glibc's malloc tunables (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, ...): how much freed memory
        # a rank keeps is set where the run is started, like the rest of its environment.
        env.update({k: v for k, v in os.environ.items() if k.startswith("MALLOC_")})
        env.update(allocator_env(self.allocator))
        return env
