"""Consolidate a checkpoint's fragments into full weights that transformers' from_pretrained loads."""

from __future__ import annotations

import json
from pathlib import Path

from elastictrain.checkpoint.store import MANIFEST


def export_checkpoint(checkpoint: Path, out_dir: Path, dtype: str = "float32") -> list[Path]:
    import torch
    from safetensors.torch import save_file

    from elastictrain.checkpoint.zero_state import FragmentReader
    from elastictrain.worker.model import build_hf_config

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    files = [checkpoint / f["name"] for f in manifest["files"] if f["name"].endswith(".safetensors")]
    reader = FragmentReader(files)
    torch_dtype = getattr(torch, dtype)
    state = {name: reader.full(name).to(torch_dtype).contiguous() for name in sorted(reader.params)}
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    hf_config = build_hf_config(dict(manifest["model"]["hf_config"]))
    hf_config.save_pretrained(out_dir)
    return [weights, out_dir / "config.json"]
