"""The 3-D layout: P pipeline stages x T tensor-parallel ranks x D data-parallel replicas, for a world size.

Every candidate (P, T, D, ZeRO stage) gets an estimated step time and memory per rank from the model's
shape, the hardware and the batch, under this cost model:

- compute: 6 x parameters x tokens (forward and backward) of a replica's share of the global batch,
  over its P x T ranks at the sustained FLOP/s of one;
- pipeline bubble: a replica of P stages running m micro-batches a step idles (P - 1) / m of its compute
  (GPipe and 1F1B alike);
- tensor parallelism: 4 all-reduces a layer per micro-batch (2 forward, 2 backward) of its activations
  (micro batch x sequence x hidden), each moving 2 (T - 1) / T of them per rank, within a node;
- pipeline: each stage boundary passes a micro-batch's activations forward and their gradient back, over
  the network when a replica's P x T ranks span nodes;
- data parallelism: the gradients of a rank's slice (parameters / (P x T)) all-reduced (ZeRO-1: reduced,
  scattered and gathered, the same bytes) over 2 (D - 1) / D, over the network when the world spans
  nodes; ZeRO-3 moves 1.5 times that (its parameters gathered forward and backward). DeepSpeed overlaps
  it with the backward pass (two thirds of the compute): only what exceeds that is counted. Tensor and
  pipeline traffic sit on the critical path and count whole;
- the choice: the least estimated step that fits; one within `CLOSE` of it with fewer ranks a replica
  (a simpler layout, less to go wrong) is preferred;
- memory: model states of a rank's slice (core/memory_estimate.py, ZeRO over the D replicas), and the
  activations its stage keeps: those of its layers for every micro-batch in flight (P of them at the
  first stage under 1F1B), over T.

DeepSpeed's pipeline engine runs ZeRO 0 or 1 only: with P > 1 the candidates are ZeRO-1 (0 with one
replica). T must divide the ranks of a node and the attention and key/value heads (AutoTP splits heads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastictrain.core.layout import ModelShape, activation_bytes
from elastictrain.core.memory_estimate import estimate_rank_memory

GIB = 2**30
BACKWARD_SHARE = 2 / 3  # of the compute: the backward pass, which data-parallel traffic overlaps
CLOSE = 0.02  # estimates this close are a tie the simpler layout wins


@dataclass(frozen=True)
class Hardware:
    memory_bytes: int  # what one rank may use (its device's; on CPU its share of the host)
    flops: float  # sustained FLOP/s of one rank in the training precision
    intra_node_bytes_s: float  # between two ranks of a node (NVLink, PCIe; loopback on CPU)
    inter_node_bytes_s: float  # between nodes, per rank (the network)
    ranks_per_node: int
    on_gpu: bool = True


@dataclass(frozen=True)
class Batch:
    global_batch: int  # sequences per optimizer step
    seq_len: int
    micro_batch: int  # sequences per micro-batch
    precision: str = "bf16"


@dataclass(frozen=True)
class Degrees:
    pipeline: int
    tensor: int
    replicas: int
    zero_stage: int

    @property
    def ranks(self) -> int:
        return self.pipeline * self.tensor * self.replicas

    def describe(self) -> str:
        return f"P {self.pipeline} x T {self.tensor} x D {self.replicas}, ZeRO-{self.zero_stage}"


@dataclass(frozen=True)
class Estimate:
    degrees: Degrees
    compute_s: float
    bubble_s: float
    tensor_s: float
    pipeline_s: float
    data_s: float
    memory_bytes: int
    fits: bool

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tensor_s + self.pipeline_s + self.data_s

    def describe(self) -> str:
        fit = "fits" if self.fits else "does not fit"
        return (
            f"{self.degrees.describe()}: about {self.step_s:.3g}s a step (compute {self.compute_s:.3g}, "
            f"bubble {self.bubble_s:.3g}, tensor {self.tensor_s:.3g}, pipeline {self.pipeline_s:.3g}, data "
            f"{self.data_s:.3g}), {self.memory_bytes / GIB:.1f} GiB a rank ({fit})"
        )


def _width(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def estimate(shape: ModelShape, d: Degrees, hw: Hardware, batch: Batch) -> Estimate:
    """The step time and per-rank memory of one candidate (see the module's docstring)."""
    p, t, r = d.pipeline, d.tensor, d.replicas
    w = _width(batch.precision)
    sequences = batch.global_batch / r  # a replica's share
    micro = max(1.0, sequences / batch.micro_batch)  # micro-batches a replica runs a step
    compute = 6 * shape.params * sequences * batch.seq_len / (p * t * hw.flops)
    bubble = compute * (p - 1) / micro
    act = batch.micro_batch * batch.seq_len * shape.hidden * w  # one boundary's activations
    tensor = 0.0
    if t > 1:
        tensor = (shape.layers / p) * micro * 4 * act * 2 * (t - 1) / t / hw.intra_node_bytes_s
    replica_spans_nodes = p * t > hw.ranks_per_node
    pipe = 0.0
    if p > 1:
        pipe = 2 * micro * act / t / (hw.inter_node_bytes_s if replica_spans_nodes else hw.intra_node_bytes_s)
    world_spans_nodes = d.ranks > hw.ranks_per_node
    slice_bytes = shape.params / (p * t) * w
    data = 0.0
    if r > 1:
        volume = 2 * (r - 1) / r * slice_bytes * (1.5 if d.zero_stage >= 3 else 1.0)
        total = volume / (hw.inter_node_bytes_s if world_spans_nodes else hw.intra_node_bytes_s)
        data = max(0.0, total - BACKWARD_SHARE * compute)
    states = estimate_rank_memory(
        max(1, shape.params // (p * t)),
        max(1, shape.largest_layer // t),
        r,
        zero_stage=d.zero_stage,
        precision=batch.precision,
        offload_optimizer="none",
        offload_param="none",
        use_gpu=hw.on_gpu,
    )
    stage = replace(shape, layers=max(1, -(-shape.layers // p)))
    in_flight = min(p, int(micro))  # 1F1B: the first stage holds up to P micro-batches' activations
    acts = in_flight * activation_bytes(stage, batch.micro_batch * batch.seq_len, batch.precision, False) // t
    memory = (states.device_bytes if hw.on_gpu else states.host_need) + acts
    return Estimate(d, compute, bubble, tensor, pipe, data, int(memory), memory <= hw.memory_bytes)


def candidates(shape: ModelShape, world: int, hw: Hardware, heads: int, kv_heads: int) -> list[Degrees]:
    """Every (P, T, D, ZeRO stage) with P x T x D = world: T divides a node's ranks and the heads, P at most
    the layers; ZeRO-1 and 3 without pipelines, ZeRO-1 (0 with one replica) with them."""
    out: list[Degrees] = []
    for t in range(1, min(world, hw.ranks_per_node) + 1):
        if hw.ranks_per_node % t or heads % t or kv_heads % t:
            continue
        for p in range(1, min(shape.layers, world // t) + 1):
            if world % (p * t):
                continue
            r = world // (p * t)
            stages = (1, 3) if p == 1 else ((1,) if r > 1 else (0,))
            out.extend(Degrees(p, t, r, z) for z in stages)
    return out


def choose_parallel_layout(
    shape: ModelShape, world: int, hw: Hardware, batch: Batch, heads: int, kv_heads: int
) -> tuple[Estimate, Estimate | None]:
    """The candidate that fits with the least estimated step time, and the runner-up (None when alone).
    Nothing fitting: the candidate needing the least memory, marked as not fitting."""
    estimates = [estimate(shape, d, hw, batch) for d in candidates(shape, world, hw, heads, kv_heads)]
    if not estimates:
        raise ValueError(f"no layout of {world} ranks: {heads} heads and {hw.ranks_per_node} ranks a node")
    return pick(estimates)


def pick(estimates: list[Estimate]) -> tuple[Estimate, Estimate | None]:
    """Of `estimates` (at least one), the one that fits with the least step time, a simpler one within
    CLOSE of it preferred, and the runner-up (None when alone). Nothing fitting: the one needing the
    least memory, marked as not fitting."""
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_s)
    if not fitting:
        return min(estimates, key=lambda e: e.memory_bytes), None
    fastest = fitting[0].step_s

    def simpler(e: Estimate) -> tuple[bool, int, int, int, float]:
        d = e.degrees
        return (e.step_s > fastest * (1 + CLOSE), d.pipeline * d.tensor, d.pipeline, d.zero_stage, e.step_s)

    fitting.sort(key=simpler)
    return fitting[0], fitting[1] if len(fitting) > 1 else None


# What `scaling.pipeline_parallel: auto` assumes of the hardware it cannot measure before the run: the
# sustained FLOP/s of one rank (on a GPU 40% of an H100's dense bf16 peak; a CPU worker's core at fp32,
# 20 GFLOP/s) and the bytes per second between two ranks of a node and between nodes (NVLink-class and
# 100 Gb/s on GPUs; loopback and 10 Gb/s on CPUs). Ratios between candidates, not absolute times, decide.
ASSUMED_GPU = (0.4 * 989e12, 150e9, 12.5e9)
ASSUMED_CPU = (2e10, 5e9, 1.25e9)


def assumed_hardware(memory_bytes: int, ranks_per_node: int, *, on_gpu: bool) -> Hardware:
    flops, intra, inter = ASSUMED_GPU if on_gpu else ASSUMED_CPU
    return Hardware(memory_bytes, flops, intra, inter, ranks_per_node, on_gpu=on_gpu)


def stage_candidates(
    shape: ModelShape, world: int, global_batch: int, zero_stage: int, *, pipelines: bool
) -> list[Degrees]:
    """`pipeline_parallel: auto`'s candidates at `world` ranks, without tensor parallelism: P stages of
    D = world / P replicas splitting the global batch, P at most the decoder layers plus the embedding
    and the head (with LoRA the decoder layers: a stage must hold adapters to train), and only P 1 where
    pipelines are not allowed; ZeRO as set (0 or 1 with pipelines)."""
    out = [Degrees(1, 1, world, zero_stage)]
    most = shape.layers if shape.trainable else shape.layers + 2
    for p in range(2, min(world, most) + 1) if pipelines else ():
        if world % p == 0 and global_batch % (world // p) == 0:
            out.append(Degrees(p, 1, world // p, zero_stage if zero_stage in (0, 1) else 1))
    return out


def split_stages(costs: list[int], stages: int) -> list[int]:
    """Contiguous stages of the layers whose costs are `costs` (the embedding's folded into the first
    layer's, the final norm's and head's into the last's), the largest stage's cost as small as it can be:
    the index of each stage's first layer."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"{stages} pipeline stages for {n} layers; expected 1 to {n}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the least largest-stage cost splitting the first i layers into k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]
