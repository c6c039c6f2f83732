"""The automatic layout: ZeRO stage, offload, activation checkpointing and micro batch for a world size.

`deepspeed.zero_stage`, `offload_optimizer`, `offload_param`, `activation_checkpointing` and
`training.micro_batch_size` may each be `auto`. From the model's shape, the memory a rank has (the
accelerator's, or its share of the host's on CPU), the world size and the global batch, `choose_layout`
takes the first setting in `LADDER` that fits, the ladder ordered from the least communication and
recomputation to the most:

1. ZeRO 0, 1, 2, then 3 (stages 1 and 2 move as many bytes as plain data parallelism, ZeRO paper
   section 7; stage 3 gathers every layer's weights each pass, 1.5x), all without checkpointing (stage 0
   in fp32 only: elastic checkpoints of bf16 and fp16 need stage 1 or more, core/zero.py);
2. the same with activation checkpointing (one more forward per step, about a third more compute);
3. the optimizer offloaded to the host (its state over PCIe each step, Adam on the CPU), then the
   parameters too, then (with `deepspeed.nvme_path`) to NVMe.

A setting fits when the model states (core/memory_estimate.py), the activations of its micro batch and
a fixed reserve stay within the usable memory (`MARGIN` below the total), on the device and on the host.
Its micro batch is the largest that divides each replica's share of the global batch and fits; a setting
is passed over when that micro batch holds fewer than `MIN_MICRO_TOKENS` tokens while a later one would
hold enough (a GPU's matrix units idle below that). What the user set stays as set: the ladder keeps only
the settings that agree with it.

Activations follow a Llama-style decoder (attention through SDPA or flash attention: no score matrix
kept), measured with torch's saved-tensor hooks on transformers' Llama (tests/unit/test_layout.py): per
token and layer, 8 x hidden + 2 x key/value width + 4 x intermediate elements in the training precision,
plus the fp32 copies RMSNorm keeps in mixed precision (2 x hidden x 2 bytes); with checkpointing, the
layer's input only. The logits are counted once: kept (4 bytes per vocabulary entry and token), their
fp32 gradient and its copy in the training precision. One layer's activations more cover backward's
working set, two with checkpointing (it recomputes a layer first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from elastictrain.core.memory_estimate import GIB, estimate_rank_memory, gathered_params
from elastictrain.core.zero import stage_problems

MARGIN = 0.10  # of each memory: the allocator's fragmentation and what the estimate leaves out
# On a GPU besides the states and activations: the CUDA context, NCCL's buffers, cuBLAS's workspace.
DEVICE_RESERVE_BYTES = int(1.5 * GIB)
MIN_MICRO_TOKENS = 4096  # tokens per micro batch below which a setting with fewer passes wins
AUTO_FIELDS = (
    "zero_stage",
    "offload_optimizer",
    "offload_param",
    "activation_checkpointing",
    "micro_batch_size",
)


@dataclass(frozen=True)
class ModelShape:
    """What the choice needs of the model: its parameters and a decoder layer's widths."""

    params: int
    largest_layer: int  # parameters of the largest module (what ZeRO-3 gathers whole)
    hidden: int
    intermediate: int
    kv_width: int  # key/value heads x head size (hidden without grouped-query attention)
    layers: int
    vocab: int
    zero3_live: int = 0  # parameters ZeRO-3 may hold gathered at once (stage3_max_live_parameters)
    trainable: int = 0  # parameters the optimizer updates where fewer than all (LoRA); 0: all


@dataclass(frozen=True)
class Layout:
    zero_stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    activation_checkpointing: bool = False
    micro_batch_size: int = 0  # 0 until chosen

    def describe(self) -> str:
        offload = "no offload"
        if self.offload_optimizer != "none":
            offload = f"optimizer offloaded to {self.offload_optimizer}"
            if self.offload_param != "none":
                offload += f", parameters to {self.offload_param}"
        ckpt = "activation checkpointing" if self.activation_checkpointing else "no activation checkpointing"
        micro = f", micro batch {self.micro_batch_size}" if self.micro_batch_size else ""
        return f"ZeRO-{self.zero_stage}, {offload}, {ckpt}{micro}"

    def agrees(self, fixed: Mapping[str, Any]) -> bool:
        return all(getattr(self, k) == v for k, v in fixed.items() if k != "micro_batch_size")


def _ladder() -> tuple[Layout, ...]:
    plain = [Layout(s) for s in (0, 1, 2, 3)]
    rungs = plain + [replace(x, activation_checkpointing=True) for x in plain]
    for ckpt in (False, True):
        rungs += [Layout(s, "cpu", "none", ckpt) for s in (2, 3)]
    rungs += [Layout(3, "cpu", "cpu", ckpt) for ckpt in (False, True)]
    rungs += [
        Layout(3, "nvme", "none", True),
        Layout(3, "nvme", "cpu", True),
        Layout(3, "nvme", "nvme", True),
    ]
    return tuple(rungs)


LADDER = _ladder()


@dataclass(frozen=True)
class Memory:
    """What one rank may use, in bytes: its accelerator (0 on a CPU-only run) and its share of the host."""

    device: int
    host: int
    nvme: bool = False  # whether deepspeed.nvme_path is set

    @property
    def on_gpu(self) -> bool:
        return self.device > 0


@dataclass(frozen=True)
class Need:
    """A setting's estimate per rank, in bytes."""

    states: int  # model states where the training runs (device on a GPU, host on CPU)
    activations: int
    device: int  # everything on the device (0 on CPU)
    host: int  # everything on the host


@dataclass(frozen=True)
class LayoutChoice:
    layout: Layout
    need: Need
    usable_device: int
    usable_host: int
    world_size: int
    fits: bool  # False: nothing fits; `layout` is the one needing the least
    passed_over: tuple[tuple[Layout, str], ...] = ()

    def lines(self) -> list[str]:
        """The start's two lines: the choice, and the estimate it came from."""
        what = (
            self.layout.describe() if self.fits else f"nothing fits; least memory: {self.layout.describe()}"
        )
        head = f"layout (auto) at world size {self.world_size}: {what}"
        where = "device" if self.usable_device else "host"
        usable = self.usable_device or self.usable_host
        total = self.need.device or self.need.host
        est = (
            f"layout estimate per rank: model states {self.need.states / GIB:.2f} GiB + activations "
            f"{self.need.activations / GIB:.2f} GiB = {total / GIB:.2f} GiB of {usable / GIB:.2f} GiB usable "
            f"on the {where} ({MARGIN:.0%} margin"
            + (
                f", {DEVICE_RESERVE_BYTES / GIB:.1f} GiB reserved for CUDA and NCCL)"
                if self.usable_device
                else ")"
            )
        )
        if self.usable_device:
            est += f"; host {self.need.host / GIB:.2f} of {self.usable_host / GIB:.2f} GiB"
        if self.passed_over:
            last, why = self.passed_over[-1]
            est += f"; passed over {len(self.passed_over)} setting(s), the last {last.describe()}: {why}"
        return [head, est]


def _elements(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def kept_activation_bytes(shape: ModelShape, tokens: int, precision: str, checkpointing: bool) -> int:
    """What a micro batch's forward keeps for backward, per rank (what torch's saved-tensor hooks see)."""
    w = _elements(precision)
    kept_per_layer = tokens * w * shape.hidden if checkpointing else _layer_bytes(shape, tokens, w)
    edges = tokens * (w * 4 * shape.hidden + 4 * shape.vocab)  # embedding output, final norm, logits
    return shape.layers * kept_per_layer + edges


def activation_bytes(shape: ModelShape, tokens: int, precision: str, checkpointing: bool) -> int:
    """A micro batch's activations at their peak in backward (see the module's docstring)."""
    w = _elements(precision)
    working = (2 if checkpointing else 1) * _layer_bytes(shape, tokens, w)
    logit_grads = tokens * shape.vocab * (4 + w)
    return kept_activation_bytes(shape, tokens, precision, checkpointing) + working + logit_grads


def _layer_bytes(shape: ModelShape, tokens: int, w: int) -> int:
    h, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    return tokens * (w * (8 * h + 2 * kv + 4 * i) + (4 - w) * 2 * h)


def need(
    shape: ModelShape, layout: Layout, world_size: int, tokens: int, precision: str, on_gpu: bool
) -> Need:
    """The per-rank estimate of a setting whose micro batch holds `tokens` tokens."""
    largest = gathered_params(shape.largest_layer, shape.params, shape.zero3_live, layout.zero_stage)
    trained = shape.trainable or shape.params
    states = estimate_rank_memory(
        trained,
        min(largest, trained),
        world_size,
        zero_stage=layout.zero_stage,
        precision=precision,
        offload_optimizer=layout.offload_optimizer,
        offload_param=layout.offload_param,
        use_gpu=on_gpu,
    )
    # Frozen weights (LoRA's base model): only their training copy, partitioned by ZeRO-3 alone.
    frozen = (shape.params - trained) * _elements(precision) // (world_size if layout.zero_stage >= 3 else 1)
    frozen_on_device = frozen if on_gpu and layout.offload_param == "none" else 0
    acts = activation_bytes(shape, tokens, precision, layout.activation_checkpointing)
    if on_gpu:
        on_device = states.device_bytes + frozen_on_device
        device = on_device + acts + DEVICE_RESERVE_BYTES
        return Need(on_device, acts, device, states.host_bytes + frozen - frozen_on_device)
    host = states.host_need + frozen + acts
    return Need(states.host_need + frozen, acts, 0, host)


def divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def choose_layout(
    shape: ModelShape,
    memory: Memory,
    *,
    world_size: int,
    data_parallel: int,
    global_batch_size: int,
    seq_len: int,
    precision: str,
    fixed: Mapping[str, Any],
) -> LayoutChoice:
    """The first setting of LADDER that agrees with `fixed` (the user's explicit values) and fits, with
    its largest micro batch (`fixed["micro_batch_size"]` when set). Raises ValueError when the global
    batch does not split over `data_parallel` replicas."""
    if data_parallel < 1 or global_batch_size % data_parallel:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} does not split over {data_parallel} replica(s)"
        )
    per_replica = global_batch_size // data_parallel
    micro_fixed = fixed.get("micro_batch_size")
    micros = [int(micro_fixed)] if micro_fixed else divisors_descending(per_replica)
    usable_device = int(memory.device * (1 - MARGIN))
    usable_host = int(memory.host * (1 - MARGIN))
    enough_tokens = min(MIN_MICRO_TOKENS, per_replica * seq_len)
    rungs = [
        x
        for x in LADDER
        if x.agrees(fixed)
        and (memory.nvme or "nvme" not in (x.offload_optimizer, x.offload_param))
        and not stage_problems(x.zero_stage, x.offload_optimizer, x.offload_param, precision)
    ]
    if not rungs:  # a combination the ladder does not list (e.g. ZeRO-1 with offload): take it as given
        rungs = [Layout(**{k: v for k, v in fixed.items() if k != "micro_batch_size"})]
    passed: list[tuple[Layout, str]] = []
    small: tuple[Layout, Need] | None = None  # the first that fits with too few tokens per micro batch
    least: tuple[Layout, Need] | None = None
    for rung in rungs:
        for micro in micros:
            n = need(shape, rung, world_size, micro * seq_len, precision, memory.on_gpu)
            if least is None or _total(n) < _total(least[1]):
                least = (replace(rung, micro_batch_size=micro), n)
            if _fits(n, usable_device, usable_host, memory.on_gpu):
                chosen = replace(rung, micro_batch_size=micro)
                if micro * seq_len >= enough_tokens or micro_fixed:
                    return LayoutChoice(
                        chosen, n, usable_device, usable_host, world_size, True, tuple(passed)
                    )
                small = small or (chosen, n)
                passed.append((chosen, f"only micro batch {micro} ({micro * seq_len} tokens) fits"))
                break
        else:
            passed.append((rung, "does not fit at micro batch " + str(micros[-1])))
    if small is not None:  # no setting reaches enough tokens: the first that fits at all
        return LayoutChoice(small[0], small[1], usable_device, usable_host, world_size, True, tuple(passed))
    assert least is not None
    return LayoutChoice(least[0], least[1], usable_device, usable_host, world_size, False, tuple(passed))


def _total(n: Need) -> int:
    return n.device or n.host


def _fits(n: Need, usable_device: int, usable_host: int, on_gpu: bool) -> bool:
    if on_gpu:
        return n.device <= usable_device and n.host <= usable_host
    return n.host <= usable_host
