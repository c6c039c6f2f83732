"""`auto` layout fields on the driver: the memory each rank has, the model's shape, the choice per world size.

At the start the choice is made for scaling.min_workers ranks (where each rank's share is largest) and
its two lines printed; before every attempt the control loop asks again for the attempt's world size
(`LayoutChooser.choose`), so a shrink that no longer fits moves to a higher ZeRO stage, offload or
checkpointing, and a grow may move back. Checkpoints and in-memory snapshots load under any stage. The
rule itself is pure (core/layout.py); this module reads what it needs: the devices' and hosts' memory
on the worker nodes (or this machine for `--local`) and the decoder's widths from its transformers config.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Any

from elastictrain.config.layout_check import AUTO, DEEPSPEED_FIELDS, auto_fields
from elastictrain.core.layout import Layout, LayoutChoice, Memory, ModelShape, choose_layout
from elastictrain.driver.preflight import PreflightError, model_parts


def fixed_values(config: Any) -> dict[str, Any]:
    """The layout fields the user set (not auto): the choice keeps them."""
    ds = config.deepspeed
    fixed = {f: getattr(ds, f) for f in DEEPSPEED_FIELDS if getattr(ds, f) != AUTO}
    if "activation_checkpointing" in fixed:
        fixed["activation_checkpointing"] = bool(fixed["activation_checkpointing"])
    if config.training.micro_batch_size != AUTO:
        fixed["micro_batch_size"] = int(config.training.micro_batch_size)
    return fixed


def model_shape(config: Any) -> ModelShape:
    """The decoder's widths (its transformers config) and parameters (the model built empty)."""
    from transformers import AutoConfig

    from elastictrain.config.deepspeed_config import live_parameters
    from elastictrain.model.build import build_hf_config

    m = config.model
    if m.pretrained:
        hf = AutoConfig.from_pretrained(m.pretrained, local_files_only=True)
    else:
        hf = build_hf_config(dict(m.hf_config))
    hf = getattr(hf, "text_config", None) or hf  # a multimodal config's language model
    hidden = int(hf.hidden_size)
    heads = int(getattr(hf, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(hf, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    sizes, largest, _ = model_parts(config)
    trainable = 0
    if m.lora.enabled:  # adapters of rank r on each targeted linear layer: a small share; 1% bounds it
        trainable = max(1, sum(sizes) // 100)
    return ModelShape(
        params=sum(sizes),
        largest_layer=largest,
        hidden=hidden,
        intermediate=int(getattr(hf, "intermediate_size", None) or 4 * hidden),
        kv_width=kv_heads * head_dim,
        layers=int(hf.num_hidden_layers),
        vocab=int(hf.vocab_size),
        zero3_live=live_parameters(config),
        trainable=trainable,
    )


def gpu_memory_probe() -> int | None:
    """Runs on one node: the smallest of its GPUs' total memory in bytes (None: no GPU seen)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        mib = [int(line) for line in out.split() if line.strip().isdigit()]
        return min(mib) << 20 if mib else None
    except (OSError, subprocess.SubprocessError, ValueError):
        try:
            import torch

            if torch.cuda.is_available():
                return min(
                    torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
                )
        except Exception:  # noqa: BLE001 - a broken CUDA install reads as no GPU
            return None
    return None


def _node_answer() -> tuple[int | None, int | None]:
    from elastictrain.driver.preflight import node_memory_probe

    return node_memory_probe()[1], gpu_memory_probe()


def rank_memory(config: Any, timeout_s: float = 60.0) -> Memory | None:
    """What one rank may use on the worker nodes: the smallest GPU (with use_gpu) and the smallest host
    share (a node's memory over the ranks it holds). None while no worker node answers."""
    from elastictrain.cluster.nodes import on_each_node, worker_nodes
    from elastictrain.driver.preflight import node_slots

    nodes = worker_nodes(config)
    answers, _ = on_each_node(nodes, _node_answer, timeout_s=timeout_s) if nodes else ([], [])
    return _smallest(config, [(node_slots(n.get("Resources", {}), config), *a) for n, a in answers])


def rank_memory_here(config: Any) -> Memory | None:
    """`--local`: this machine is the one rank's."""
    host, gpu = _node_answer()
    return _smallest(config, [(1, host, gpu)])


def _smallest(config: Any, nodes: list[tuple[int, int | None, int | None]]) -> Memory | None:
    use_gpu = config.scaling.use_gpu
    known = [(ranks, host, gpu) for ranks, host, gpu in nodes if ranks > 0 and host and (gpu or not use_gpu)]
    if not known:
        return None
    host = min(h // r for r, h, _ in known if h)
    device = min(int(g) for _, _, g in known if g) if use_gpu else 0
    return Memory(device, host, nvme=bool(config.deepspeed.nvme_path))


@dataclass
class LayoutChooser:
    """The choice's inputs, read once at the start; `choose` at each attempt's world size."""

    config: Any
    shape: ModelShape
    memory: Memory
    fixed: dict[str, Any]
    current: Layout | None = field(default=None)

    def choose(self, world_size: int, tensor_parallel: int = 1) -> LayoutChoice:
        c = self.config
        return choose_layout(
            self.shape,
            self.memory,
            world_size=world_size,
            data_parallel=world_size // tensor_parallel,
            global_batch_size=c.training.global_batch_size,
            seq_len=c.data.seq_len,
            precision=c.training.precision,
            fixed=self.fixed,
        )

    def apply(self, choice: LayoutChoice) -> bool:
        """Set the chosen values in the run's config (every later reader sees them); whether they changed."""
        chosen = choice.layout
        ds, t = self.config.deepspeed, self.config.training
        for name in DEEPSPEED_FIELDS:
            setattr(ds, name, getattr(chosen, name))
        t.micro_batch_size = chosen.micro_batch_size
        changed = chosen != self.current
        self.current = chosen
        return changed


def choose_at_start(config: Any, memory: Memory | None) -> tuple[LayoutChoice, LayoutChooser]:
    """Resolve the auto fields for scaling.min_workers ranks: sets them in `config`, returns the choice
    (its `lines()` say what was chosen and from which estimate) and the chooser the control loop asks again.
    Raises PreflightError where nothing fits, or where no node says how much memory it has."""
    names = ", ".join(auto_fields(config))
    if memory is None:
        raise PreflightError(
            f"{names}: auto needs each worker node's memory (and GPU memory with scaling.use_gpu), and no "
            "worker node answered; start the workers' nodes first, or set the fields to values"
        )
    chooser = LayoutChooser(config, model_shape(config), memory, fixed_values(config))
    s = config.scaling
    tensor_parallel = int(s.tensor_parallel) if s.tensor_parallel != AUTO else 1
    choice = chooser.choose(s.min_workers, tensor_parallel)
    if not choice.fits:
        raise PreflightError(
            f"{names}: auto found no layout that fits at scaling.min_workers={s.min_workers}: "
            + "; ".join(choice.lines())
            + ". Add ranks (scaling.min_workers), use bf16, set deepspeed.nvme_path for NVMe offload, "
            "shorten data.seq_len, or train a smaller model"
        )
    chooser.apply(choice)
    return choice, chooser


def resolve_in_this_process(config: Any) -> None:
    """`elastictrain eval`: auto fields set for the one rank in this process (an evaluation only runs
    forward, so the choice is kept even where training would not fit)."""
    if not auto_fields(config):
        return
    memory = rank_memory_here(config) or Memory(0, 1 << 40)
    chooser = LayoutChooser(config, model_shape(config), memory, fixed_values(config))
    chooser.apply(chooser.choose(1))
