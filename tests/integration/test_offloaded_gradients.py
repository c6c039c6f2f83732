"""With the optimizer offloaded on a CPU-only machine, a ZeRO-3 rank keeps its gradients once, and the
update is exactly DeepSpeed's own.

One process at world size 1 (gloo) builds the same tiny Llama twice under ZeRO-3 with the optimizer
offloaded to the host, trains both on the same batches with gradient accumulation and clipping (the two
places DeepSpeed writes the optimizer's gradients: the boundary copy and the in-place clip), once with
`share_offloaded_gradients` and once as DeepSpeed leaves it, and compares the fp32 weights and Adam's
moments bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from readme_blocks import free_ports

pytestmark = pytest.mark.integration

SCRIPT = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from elastictrain.compat.deepspeed.cpu_info import remember_cpu_info
# As each worker does: py-cpuinfo probes the CPU in a child process (about 1 CPU s) at each CPU
# Adam and async I/O build.
remember_cpu_info()
import deepspeed, torch
from transformers import LlamaConfig, LlamaForCausalLM
from elastictrain.compat.deepspeed.zero3_memory import share_offloaded_gradients

deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
DS = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05,  # small enough to clip every step
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
}

def train(share):
    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(hf)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=DS)
    freed = share_offloaded_gradients(engine, cpu_only=True) if share else 0
    batches = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3 * 2):  # 3 optimizer steps of 2 micro-batches
        ids = torch.randint(0, 64, (2, 16), generator=batches)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    opt = engine.optimizer
    flat = opt.grad_partitions_flat_buffer.untyped_storage().data_ptr()
    state = {}
    for i, master in enumerate(opt.fp32_partitioned_groups_flat):
        state[f"fp32.{i}"] = master.detach().clone()
        for name, value in opt.optimizer.state[master].items():
            if torch.is_tensor(value) and value.numel() > 1:
                state[f"{name}.{i}"] = value.detach().clone()
    shared = sum(m.grad.untyped_storage().data_ptr() == flat for m in opt.fp32_partitioned_groups_flat)
    return freed, shared, len(opt.fp32_partitioned_groups_flat), losses, state

freed, shared, groups, losses, state = train(share=True)
_, shared_before, _, losses_ref, state_ref = train(share=False)
assert state.keys() == state_ref.keys() and len(state) >= 3, sorted(state)
differing = [k for k in state if not torch.equal(state[k], state_ref[k])]
print(json.dumps({
    "freed": freed, "shared": shared, "shared_before": shared_before, "groups": groups,
    "losses": losses, "losses_ref": losses_ref, "differing": differing, "fields": sorted(state),
}))
"""


def test_offloaded_optimizer_reads_its_gradients_in_place_and_updates_exactly_as_deepspeed_does():
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_ports(1)[0])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # DeepSpeed alone keeps a second buffer; shared, every sub-group's gradient is a view of the flat one.
    assert out["shared_before"] == 0
    assert out["shared"] == out["groups"] >= 1
    assert out["freed"] > 0
    assert out["losses"] == out["losses_ref"]
    assert out["differing"] == [], out["fields"]
