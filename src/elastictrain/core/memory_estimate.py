"""How much memory a rank needs for a model, ZeRO stage, precision and offload: decided before any worker.

The model states follow DeepSpeed's own accounting (`estimate_zero3_model_states_mem_needs` and the
ZeRO paper), per parameter, divided between the ranks by ZeRO:

- the training copy of the weights: 4 bytes in fp32, 2 in bf16/fp16;
- gradients: ZeRO keeps its partitioned gradients in fp32 for the optimizer (4 bytes), whatever the
  training precision;
- the optimizer's fp32 master weights (4 bytes), except in ZeRO-3 fp32 with the optimizer on the
  device, where the training copy is the master (DeepSpeed 0.19 means to alias them but keeps a
  second copy; the worker drops it: compat/deepspeed/zero3_memory.py);
- Adam's two moments (8 bytes).

So Adam costs 16 bytes per parameter in ZeRO-3 fp32, 20 in fp32 with the optimizer offloaded, and
18 in mixed precision (the ZeRO paper's 16 plus the fp32 gradient partition), all of it divided by
the world size under ZeRO-3. Stage 1 divides only the optimizer's bytes, stage 2 the gradients too,
stage 0 nothing. Offloading the optimizer moves its bytes (and the fp32 gradients) from the device to
the host, or to NVMe; offloading the parameters moves the training copy too. On a CPU-only machine
device and host are the same memory.

On top: the largest layer gathered whole, with its whole gradient computed before the reduce-scatter
partitions it, in the training precision (DeepSpeed's `largest_layer_memory`: 2 bytes of fp16 weights
and 2 of fp16 gradients per parameter, so 8 in fp32; the caller passes ZeRO-3's live-parameter bound
where larger), the host buffers an NVMe
swap stages through (`swap_buffer_bytes`), and the runtime's own baseline per process (Python, torch,
DeepSpeed, the Ray actor).

On a CPU-only machine one more term counts, apart from the bound above (`retained_bytes`): what the
worker's malloc holds beyond what is allocated at the step's peak, its freed temporaries (gathered
layers, activations, gradients before their reduce-scatter) kept resident. How much depends on the
malloc (`scaling.worker_allocator`, cluster/allocator.py): glibc's spreads a step's allocations over its
whole heap, jemalloc reuses what it just freed. Per parameter of a rank's share, measured with the scale
benchmark (`make bench ARGS="--only scale"`, 2 ranks, 30M-1B): see `RETAINED_BYTES`; the lower ends
are used, so that a configuration that fits is never refused.

With tensor parallelism of degree N (`scaling.tensor_parallel`) each rank holds 1/N of every sliced
parameter (the linear layers AutoTP splits) and the rest whole, and ZeRO divides over the world / N
replicas, not over the world.

In-memory snapshots (`checkpoint.memory_every_steps`) come on top, counted apart: a worker holds up to
`SLICES_HELD` copies of its rank's slice (fp32 weights and Adam's moments, 12 bytes per parameter over
the ranks that share them). They are optional: a worker whose copies do not fit the memory
checkpointing may use turns them off, so they never make a run refuse to start.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastictrain.core.snapshot_plan import SLICES_HELD

GIB = 1 << 30
# Resident memory of one idle worker process (interpreter, torch, DeepSpeed, Ray's worker): measured
# with the scale benchmark on CPU (`make bench ARGS="--only scale"`); GPU processes add their CUDA context.
RUNTIME_BASELINE_BYTES = int(0.9 * GIB)
MOMENT_BYTES = 8  # Adam's two fp32 moments
MASTER_BYTES = 4  # the optimizer's fp32 copy of the weights, where it keeps one
GRAD_BYTES = 4  # ZeRO's partitioned gradients are fp32
SNAPSHOT_BYTES = 4 + MOMENT_BYTES  # per parameter in an in-memory snapshot: fp32 weights and moments
# Freed step temporaries the worker's malloc keeps, per parameter of a rank's share, on CPU-only runs, by
# malloc and by where the optimizer steps (measured: see the module's docstring).
RETAINED_BYTES = {
    "system": {"none": 14, "cpu": 18, "nvme": 5},
    "jemalloc": {"none": 4, "cpu": 4, "nvme": 2},
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per rank, in bytes: where the model states live, and the total the host must give each rank."""

    params: int
    world_size: int
    device_bytes: int  # on the accelerator (0 on CPU: everything is host memory)
    host_bytes: int  # model states on the host + largest layer + runtime baseline
    nvme_bytes: int  # swapped to deepspeed.nvme_path
    bytes_per_param: int  # model states per parameter before dividing by the world size
    tensor_parallel: int = 1  # ranks per replica, each holding 1/N of the sliced parameters
    snapshot_bytes: int = 0  # in-memory snapshots' copies, on the host, beyond host_bytes (0: off)
    retained_bytes: int = 0  # freed temporaries the host allocator keeps (CPU-only runs), beyond host_bytes

    @property
    def host_need(self) -> int:
        """What the host must have for each rank: the bound plus what the allocator keeps."""
        return self.host_bytes + self.retained_bytes

    def describe(self) -> str:
        where = f"{self.host_bytes / GIB:.2f} GiB host"
        if self.retained_bytes:
            where += (
                f" (+ {self.retained_bytes / GIB:.2f} GiB of freed step temporaries the allocator keeps: "
                f"{self.host_need / GIB:.2f} GiB needed)"
            )
        if self.device_bytes:
            where = f"{self.device_bytes / GIB:.2f} GiB accelerator + " + where
        if self.nvme_bytes:
            where += f" + {self.nvme_bytes / GIB:.2f} GiB NVMe"
        if self.snapshot_bytes:
            where += (
                f"; in-memory snapshots up to {self.snapshot_bytes / GIB:.2f} GiB more "
                "(turned off where they do not fit)"
            )
        layout = f" (tensor parallel {self.tensor_parallel})" if self.tensor_parallel > 1 else ""
        return (
            f"memory per rank (estimate, {self.params / 1e6:.1f}M parameters at world size "
            f"{self.world_size}{layout}, {self.bytes_per_param} bytes of model state per parameter): {where}"
        )


def estimate_rank_memory(
    params: int,
    largest_layer_params: int,
    world_size: int,
    *,
    zero_stage: int,
    precision: str,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    use_gpu: bool = False,
    baseline_bytes: int = RUNTIME_BASELINE_BYTES,
    swap_buffer_bytes: int = 0,
    memory_snapshots: bool = False,
    allocator: str = "jemalloc",
    tensor_parallel: int = 1,
    sliced_params: int = 0,
) -> MemoryEstimate:
    """Per-rank memory at `world_size` (see the module's docstring for the accounting); `sliced_params`
    of the `params` are split between the `tensor_parallel` ranks of a replica."""
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}; expected >= 1")
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise ValueError(f"tensor_parallel: got {tensor_parallel}; expected a divisor of {world_size}")
    model_params = params
    # What one rank of a replica holds before ZeRO divides it over the replicas.
    params = params - sliced_params + -(-sliced_params // tensor_parallel)
    largest_layer_params = min(largest_layer_params, params)
    weight_bytes = 4 if precision == "fp32" else 2
    in_place = zero_stage >= 3 and precision == "fp32" and offload_optimizer == "none"
    optimizer_bytes = MOMENT_BYTES + (0 if in_place else MASTER_BYTES)
    share = tensor_parallel / world_size
    weights = params * weight_bytes * (share if zero_stage >= 3 else 1.0)
    grads = params * GRAD_BYTES * (share if zero_stage >= 2 else 1.0)
    optimizer = params * optimizer_bytes * (share if zero_stage >= 1 else 1.0)
    places = {"device": 0.0, "host": 0.0, "nvme": 0.0}
    places["host" if offload_param == "cpu" else "nvme" if offload_param == "nvme" else "device"] += weights
    opt_place = {"cpu": "host", "nvme": "nvme"}.get(offload_optimizer, "device")
    places[opt_place] += optimizer
    # Offloaded optimizers step on the host, so the fp32 gradient partitions live there too.
    places["device" if opt_place == "device" else "host"] += grads
    layer = largest_layer_params * 2 * weight_bytes  # its weights gathered and its gradient, whole
    retained = 0.0
    if use_gpu:
        device = places["device"] + layer
        host = places["host"] + baseline_bytes + swap_buffer_bytes
    else:
        device = 0.0
        host = places["device"] + places["host"] + layer + baseline_bytes + swap_buffer_bytes
        per_param = RETAINED_BYTES[allocator].get(offload_optimizer, 0)
        retained = params * per_param * (share if zero_stage >= 1 else 1.0)
    return MemoryEstimate(
        params=model_params,
        world_size=world_size,
        tensor_parallel=tensor_parallel,
        device_bytes=int(device),
        host_bytes=int(host),
        nvme_bytes=int(places["nvme"]),
        bytes_per_param=weight_bytes + GRAD_BYTES + optimizer_bytes,
        retained_bytes=int(retained),
        snapshot_bytes=int(
            SLICES_HELD * params * SNAPSHOT_BYTES * (share if zero_stage >= 1 else 1.0)
            if memory_snapshots
            else 0
        ),
    )


def gathered_params(largest_layer: int, params: int, live_params: int, zero_stage: int) -> int:
    """What a rank holds gathered at once: the largest layer, and under ZeRO-3 up to its live-parameter
    bound (stage3_max_live_parameters) where that is larger."""
    return max(largest_layer, min(params, live_params)) if zero_stage >= 3 else largest_layer


def largest_sub_group(partition_numels: list[int], sub_group_size: int) -> int:
    """Elements in the largest of ZeRO-3's optimizer sub-groups (DeepSpeed's `_create_fp16_sub_groups`):
    a rank's parameter partitions, in order, each sub-group closed once it reaches `sub_group_size`, so
    one may exceed it by up to a partition (the 1B preset's last holds its output layer: 64M of 50M)."""
    total = sum(partition_numels)
    if sub_group_size >= total:
        return total
    largest = running = 0
    for numel in partition_numels:
        running += numel
        if running >= sub_group_size:
            largest, running = max(largest, running), 0
    return max(largest, running)


def ranks_that_fit(
    node_memory_bytes: list[int], node_slots: list[int], per_rank_bytes: int, tensor_parallel: int = 1
) -> int:
    """How many ranks the nodes can host by memory, each node capped by its CPU/GPU slots, in whole
    tensor-parallel replicas (a replica's ranks share a node)."""
    n = tensor_parallel
    if per_rank_bytes <= 0:
        return sum(slots // n * n for slots in node_slots)
    return sum(
        min(slots, mem // per_rank_bytes) // n * n
        for mem, slots in zip(node_memory_bytes, node_slots, strict=True)
    )


def memory_shortfall(
    node_memory_bytes: list[int],
    node_slots: list[int],
    per_rank_bytes: int,
    wanted: int,
    tensor_parallel: int = 1,
) -> int | None:
    """The ranks the nodes can host when memory, not slots, keeps them under `wanted`; None otherwise.

    Fewer slots than `wanted` is a wait for capacity (nodes may join), not a reason to refuse the run."""
    n = tensor_parallel
    fit = ranks_that_fit(node_memory_bytes, node_slots, per_rank_bytes, n)
    return fit if fit < min(wanted, sum(slots // n * n for slots in node_slots)) else None
