"""A stage reads only its own tensors from a pretrained folder's safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from elastictrain.model.pipeline import PipelineRefused, _read_pretrained


def test_a_stage_reads_its_tensors_by_name_from_one_file_or_an_index(tmp_path: Path):
    weights = {
        "model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2),
        "lm_head.weight": torch.ones(2, 3),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    mine = {"lm_head.weight": torch.zeros(2, 3)}
    _read_pretrained(str(tmp_path), mine)
    assert torch.equal(mine["lm_head.weight"], torch.ones(2, 3))

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"model.norm.weight": torch.full((2,), 3.0)}, str(sharded / "b.safetensors"))
    index = {"weight_map": {"model.norm.weight": "b.safetensors", "lm_head.weight": "a.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    norm = {"model.norm.weight": torch.zeros(2)}
    _read_pretrained(str(sharded), norm)  # a.safetensors, not this stage's, is never opened (absent here)
    assert torch.equal(norm["model.norm.weight"], torch.full((2,), 3.0))


def test_a_folder_without_safetensors_or_a_weight_it_lacks_is_named(tmp_path: Path):
    with pytest.raises(PipelineRefused, match="has no model.safetensors"):
        _read_pretrained(str(tmp_path), {"lm_head.weight": torch.zeros(1)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(PipelineRefused, match=r"has no weights for \['lm_head.weight'\]"):
        _read_pretrained(str(tmp_path), {"lm_head.weight": torch.zeros(1)})
