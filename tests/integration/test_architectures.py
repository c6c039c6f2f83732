"""Issue 10: every causal LM architecture starts from transformers' own initialization, trains, round-trips.

One Ray cluster and three warm worker actors for the whole matrix (tests/integration/probe.py): per
architecture, each join attempts through the product's `TrainWorker.setup` (model built under ZeRO-3's
zero.Init, DeepSpeed engine, checkpoint loaded), so a case costs seconds, not a cold start.

Per architecture, tiny and with its default tying:
- the initial model at world size 3 is, parameter by parameter, bit-for-bit transformers' `from_config`
  with the same seed (tolerance 0: the same random stream is consumed in the same order);
- the first loss at world size 2 is the reference model's loss on the same global batch and lies near
  ln(vocab); a few real training steps make it go down;
- the checkpoint (written by the ranks, committed by the store) exported with `export_checkpoint` loads
  with `from_pretrained`, ties what the architecture ties, and gives the logits of the trained model
  loaded at another world size (3) within fp32 tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import offload_overrides, tiny_config
from probe import save_checkpoint, train_steps
from reference import causal_lm_loss, global_batch, reference_model

from elastictrain.config import validate
from elastictrain.data.sources import dataset_from_config
from elastictrain.tools.export import export_checkpoint

pytestmark = pytest.mark.integration

VOCAB = 256
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# model_type -> what differs from COMMON (head_dim where the default assumes a large model).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"head_dim": 16},
    "qwen2": {},
    "qwen2-tied": {"model_type": "qwen2", "tie_word_embeddings": True},  # Qwen2.5-0.5B style
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},  # ties by default
    "gemma3_text": {"head_dim": 16},  # ties by default
    "gpt2": {  # ties by default; scaled init of c_proj
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        # No dropout, so the first loss can be compared with the reference's exactly.
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "gpt_neox": {"num_key_value_heads": None},
    "phi3": {},
    "olmo2": {},
}
STEPS = 5
# Logits of the same weights through two code paths (ZeRO-3 engine at world size 3 vs a plain module)
# differ only by the order of floating-point sums: a few fp32 ulps of values of order 1.
LOGITS_ATOL = 1e-5


def hf_config_for(name: str) -> dict[str, Any]:
    extra = dict(ARCHITECTURES[name])
    model_type = extra.pop("model_type", name)
    if model_type == "gpt2":
        return {"model_type": "gpt2", "vocab_size": VOCAB, **extra}
    merged = {**COMMON, **extra}
    return {"model_type": model_type, **{k: v for k, v in merged.items() if v is not None}}


def config_for(name: str, run_dir: Path) -> Any:
    cfg = tiny_config(run_dir, f"training.max_steps={STEPS + 1}", "training.warmup_steps=1")
    cfg.model.hf_config = hf_config_for(name)
    return validate(cfg)


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    return sorted(sorted(names) for names in by_param.values() if len(names) > 1)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_inits_like_transformers_trains_and_exports(probes, tmp_path, name):
    cfg = config_for(name, tmp_path / "run")
    reference = reference_model(cfg)
    ref_params = dict(reference.named_parameters())

    # 1. The initial model under ZeRO-3 at world size 3 is transformers' own, bit for bit.
    probes.setup(cfg, world_size=3)
    initial = probes.full_parameters()
    assert sorted(initial) == sorted(ref_params)
    wrong = {
        n: f"std {t.std().item():.4f} vs transformers {ref_params[n].std().item():.4f}"
        for n, t in initial.items()
        if not torch.equal(t, ref_params[n].detach())
    }
    assert not wrong, f"{name}: parameters not initialised as transformers does: {wrong}"
    assert sorted(sorted(g) for g in probes.tied_names()) == tied_groups(reference)

    # 2. First loss = the reference model's on the same global batch, near ln(vocab); training lowers it.
    dataset = dataset_from_config(cfg)
    with torch.no_grad():
        ref_first = causal_lm_loss(reference, global_batch(cfg, dataset, 0)).item()
    probes.setup(cfg, world_size=2)
    losses = train_steps(probes, range(STEPS))
    assert losses[0] == pytest.approx(ref_first, abs=1e-5), (name, losses[0], ref_first)
    assert abs(losses[0] - math.log(VOCAB)) < 0.1, f"{name}: first loss {losses[0]:.3f}, ln(V) 5.545"
    assert losses[-1] < losses[0] - 0.2, f"{name}: loss did not go down: {losses}"

    # 3. Checkpoint at world size 2 -> export -> from_pretrained: the trained model's logits.
    checkpoint = save_checkpoint(probes, cfg, tmp_path / "ckpt", STEPS)
    export_checkpoint(checkpoint, tmp_path / "export")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        exported_names = set(f.keys())
    assert exported_names == set(initial), "tied weights must be stored once, untied ones each"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True).eval()
    assert tied_groups(loaded) == tied_groups(reference), "export must keep the architecture's tying"

    ids = global_batch(cfg, dataset, STEPS)[:4]
    probes.setup(cfg, world_size=3, checkpoint_dir=str(checkpoint), step=STEPS)
    trained = probes.logits(ids)
    with torch.no_grad():
        exported = loaded(input_ids=ids).logits.float()
    diff = (trained - exported).abs().max().item()
    assert diff <= LOGITS_ATOL, f"{name}: exported logits differ from the trained model's by {diff:.2e}"
    print(
        f"ARCH {name}: initial loss {losses[0]:.4f} (ref {ref_first:.4f}), loss after {STEPS} steps "
        f"{losses[-1]:.4f}, export max |logit diff| {diff:.1e}, tied {tied_groups(loaded)}"
    )


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_pretrained_weights_load_exactly_under_zero3(probes, tmp_path, offload):
    """model.pretrained: at step 0 the same logits and loss as transformers' own model from that folder."""
    cfg = config_for("llama", tmp_path / "run")
    base = reference_model(cfg)
    with torch.no_grad():  # weights unlike any fresh init, so a lost load cannot pass
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "pretrained"
    base.save_pretrained(folder)
    cfg = tiny_config(
        tmp_path / "run",
        f"model.pretrained={folder}",
        f"deepspeed.offload_optimizer={offload}",
        f"deepspeed.offload_param={offload}",
    )
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    dataset = dataset_from_config(cfg)
    batch = global_batch(cfg, dataset, 0)
    with torch.no_grad():
        own_logits = own(input_ids=batch[:4]).logits
        own_loss = causal_lm_loss(own.train(), batch).item()

    probes.setup(cfg, world_size=2)
    diff = (probes.logits(batch[:4]) - own_logits).abs().max().item()
    assert diff <= LOGITS_ATOL, f"offload={offload}: logits differ from transformers' by {diff:.2e}"
    (first,) = train_steps(probes, range(1))
    assert first == pytest.approx(own_loss, abs=1e-5), (offload, first, own_loss)


@pytest.mark.parametrize(
    ("stage", "offload"), [(3, "cpu"), (3, "nvme"), (2, "none"), (2, "cpu"), (1, "none"), (0, "none")]
)
def test_initial_model_is_transformers_own_under_every_stage_and_offload(probes, tmp_path, stage, offload):
    """Any ZeRO stage, parameters offloaded to CPU or swapped to NVMe while built: the same bits."""
    (tmp_path / "nvme").mkdir()
    overrides = offload_overrides(offload, tmp_path / "nvme") if stage == 3 else []
    if stage < 3:
        overrides = [f"deepspeed.offload_optimizer={offload}"]
    cfg = tiny_config(tmp_path / "run", f"deepspeed.zero_stage={stage}", *overrides)
    reference = dict(reference_model(cfg).named_parameters())
    probes.setup(cfg, world_size=2)
    initial = probes.full_parameters()
    wrong = [n for n, t in initial.items() if not torch.equal(t, reference[n].detach())]
    assert sorted(initial) == sorted(reference) and not wrong, f"stage {stage}, {offload}: differ: {wrong}"
