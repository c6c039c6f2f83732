"""Consolidate a checkpoint's fragments into full weights that transformers' from_pretrained loads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from elastictrain.checkpoint.store import MANIFEST


def export_checkpoint(checkpoint: Any, out_dir: Path, dtype: str = "float32") -> list[Path]:
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
    os.chmod(weights, _normal_file_mode())  # safetensors creates it 0600; config.json follows the umask
    hf_config = build_hf_config(dict(manifest["model"]["hf_config"]))
    hf_config.save_pretrained(out_dir)
    return [weights, out_dir / "config.json"]


def _normal_file_mode() -> int:
    """The mode open() gives a new file: 0666 less this process's umask (0644 with the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
