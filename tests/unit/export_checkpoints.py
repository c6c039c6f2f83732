"""Committed checkpoints made from a model in the test, as a 2-rank ZeRO-3 run writes them (fragment
files, manifest with the model's record), without Ray or DeepSpeed: what the export tests start from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from elastictrain.checkpoint.model_record import built_model, tokenizer_folder
from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.checkpoint.zero_state import Fragment, rank_file
from elastictrain.storage.durable import write_bytes_durably


def checkpoint_of(
    model: torch.nn.Module,
    root: Path,
    *,
    source: str = "pretrained",
    pretrained: Path | None = None,
    precision: str = "fp32",
    step: int = 4,
    world_size: int = 2,
    record: bool = True,
) -> Path:
    """A checkpoint of `model`'s trainable parameters (all of them, or a peft model's adapters).

    `record=False` writes an older manifest: only `model.hf_config`, taken from the model's config.
    """
    params = {n: p.detach().float() for n, p in model.named_parameters() if p.requires_grad}
    configured: dict[str, Any] = {"hf_config": _hf_config(model)}
    if record:
        folder = str(pretrained.resolve()) if pretrained else None
        configured |= {
            "source": source,
            "pretrained": folder,
            "factory": "tests:factory" if source == "factory" else None,
            "tokenizer": tokenizer_folder(None, folder),
            "precision": precision,
            "built": built_model(model),
        }
    store = CheckpointStore(root)
    staging = store.begin(step)
    entries = [_rank_file(staging, rank, world_size, params) for rank in range(world_size)]
    fields = {"world_size": world_size, "model": configured, "run_id": "test"}
    return store.commit(step, staging, entries, fields).path


def _hf_config(model: torch.nn.Module) -> dict[str, Any]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return config.to_diff_dict() if config is not None else {}


def _rank_file(staging: Path, rank: int, world_size: int, params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's ZeRO-3 partition of every parameter (ceil(numel / world_size) elements each)."""
    tensors, fragments = {}, {}
    for name, p in params.items():
        flat = p.reshape(-1)
        part = math.ceil(flat.numel() / world_size)
        start = rank * part
        length = max(0, min(part, flat.numel() - start))
        if length:
            tensors[f"{name}::fp32"] = flat[start : start + length].clone()
            fragments[name] = Fragment(start, length, flat.numel(), tuple(p.shape))
    file_name, metadata = rank_file(rank, world_size, fragments)
    data = save_safetensors(tensors, metadata=metadata)
    return {"name": file_name, "bytes": len(data), "sha256": write_bytes_durably(staging / file_name, data)}


def trained(model: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    """`model` with every trainable parameter moved, as training would (so nothing equals the source)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model
