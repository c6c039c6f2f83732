"""An engine with its optimizer state on NVMe is built without reading each sub-group in and writing it
back unchanged, a fresh one gets CPU Adam's state at the build, and it then trains exactly as
DeepSpeed's own engine, which does that round trip and creates the state at its first step.

Two processes (world size 2, gloo) each build the same tiny Llama under ZeRO-3 with the optimizer
offloaded to NVMe in several sub-groups, twice: once as DeepSpeed builds it, and once inside
`compat/deepspeed/zero3_build.optimizer_states_initialized_without_swapping` and `freed_partitions_returned`
(whose memory return must come between the partitions' flattening and the swap buffers) followed by
`compat/deepspeed/zero3_memory.create_swapped_adam_state`, counting the sub-group reads and writes in
`deepspeed.initialize`. Before the first step every swapped sub-group of ours already has its moments
swapped out (DeepSpeed's has none); both then train the same batches with gradient accumulation and
clipping, and their losses and gathered weights are compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import NVME_DS_CONFIG, script_on_two_ranks

pytestmark = pytest.mark.integration

SCRIPT = (
    r"""
import contextlib, json, os, sys
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK=sys.argv[2], WORLD_SIZE="2",
                  LOCAL_RANK="0")
import deepspeed, torch
from transformers import LlamaConfig, LlamaForCausalLM
from elastictrain.compat.deepspeed.process_state import reset_zero_counters
from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper as Swapper
import elastictrain.host_memory as host_memory
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
from elastictrain.compat.deepspeed.zero3_build import (
    freed_partitions_returned, optimizer_states_initialized_without_swapping)
from elastictrain.compat.deepspeed.zero3_memory import create_swapped_adam_state

deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
rank, folder = int(sys.argv[2]), sys.argv[3]

io = {"read": 0, "written": 0}
read, written = Swapper._swap_in_parameter, Swapper._swap_out_optimizer_state

def counting_read(self, *args, **kwargs):
    io["read"] += 1
    return read(self, *args, **kwargs)

def counting_write(self, *args, **kwargs):
    io["written"] += 1
    return written(self, *args, **kwargs)

Swapper._swap_in_parameter, Swapper._swap_out_optimizer_state = counting_read, counting_write
events = []  # in the order they happen while building
release, flatten, swapping = (host_memory.release_freed_memory,
                              Stage3._create_fp16_partitions_with_defragmentation,
                              Stage3._configure_tensor_swapping)
host_memory.release_freed_memory = lambda: events.append("memory returned") or release()
Stage3._create_fp16_partitions_with_defragmentation = (
    lambda self, *a: events.append("partitions flattened") or flatten(self, *a))
Stage3._configure_tensor_swapping = lambda self, *a: events.append("swap buffers") or swapping(self, *a)

"""
    + NVME_DS_CONFIG
    + r"""
def train(ours):
    reset_zero_counters()
    torch.manual_seed(0)
    # DeepSpeed swaps only sub-groups of at least 1 MiB: 3.3M parameters, 1.65M a rank, in 300k sub-groups.
    hf = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4)
    ds = config("ours" if ours else "theirs")
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = LlamaForCausalLM(hf)
    io.update(read=0, written=0)
    events.clear()
    built_ours = contextlib.ExitStack()
    if ours:
        built_ours.enter_context(optimizer_states_initialized_without_swapping())
        built_ours.enter_context(freed_partitions_returned())
    with built_ours:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    build_io = dict(io)
    build_events = list(events)
    opt = engine.optimizer
    allocated = []  # moments created outside the swap buffers
    zeros_like = torch.zeros_like
    torch.zeros_like = lambda t, **kw: allocated.append(t.numel()) or zeros_like(t, **kw)
    created = create_swapped_adam_state(engine) if ours else 0
    torch.zeros_like = zeros_like
    swapped = [g for g in range(len(opt.fp16_groups)) if opt._swappable_optimizer_subgroup(g)]
    masters = [opt.fp32_partitioned_groups_flat[g] for g in swapped]
    before = {
        "created": created,
        "allocated": allocated,
        "build_io": build_io,
        "build_events": build_events,
        "swapped": len(swapped),
        "with_state": sum(1 for m in masters if opt.optimizer.state.get(m)),
        # swapped out: the master and its moments are empty tensors until the next swap-in
        "held": sum(m.numel() for m in masters),
        "moment_files": sorted(p.name for p in Path(ds["zero_optimization"]["offload_optimizer"]["nvme_path"])
                               .rglob("exp_avg*")) if ours else [],
    }
    batches = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(3 * 2):  # 3 optimizer steps of 2 micro-batches
        ids = torch.randint(0, 4096, (2, 16), generator=batches)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        weights = {name: p.detach().clone() for name, p in params.items()}
    return before, losses, weights

ours, losses, weights = train(ours=True)
theirs, losses_ref, weights_ref = train(ours=False)
differing = [k for k in weights if not torch.equal(weights[k], weights_ref[k])]
print(json.dumps({"ours": ours, "theirs": theirs, "losses": losses, "losses_ref": losses_ref,
                  "differing": differing, "names": len(weights)}))
"""
)


def test_nvme_optimizer_built_without_the_swap_round_trip_and_with_adam_state_trains_exactly_as_deepspeed(
    tmp_path: Path,
) -> None:
    outs = script_on_two_ranks(SCRIPT, str(tmp_path))
    for out in outs:
        ours, theirs = out["ours"], out["theirs"]
        assert ours["swapped"] == theirs["swapped"] >= 3  # several sub-groups, each swapped to NVMe
        # DeepSpeed reads every sub-group in and writes it back unchanged while building; ours does not.
        assert theirs["build_io"] == {"read": theirs["swapped"], "written": theirs["swapped"]}
        assert ours["build_io"] == {"read": 0, "written": 0}
        assert ours["build_events"] == ["partitions flattened", "memory returned", "swap buffers"]
        assert theirs["build_events"] == ["partitions flattened", "swap buffers"]
        assert ours["created"] == ours["with_state"] == ours["swapped"]
        assert ours["allocated"] == []  # the moments were made in the sub-groups' free swap buffers
        assert theirs["with_state"] == 0  # DeepSpeed creates the moments at the first step
        assert ours["held"] == theirs["held"] == 0  # nothing left in memory after the build
        assert len(ours["moment_files"]) == 2 * ours["swapped"]  # exp_avg and exp_avg_sq per sub-group
        assert out["names"] > 0
        assert out["losses"] == out["losses_ref"]
        assert out["differing"] == []
