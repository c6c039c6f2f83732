"""A `model.hf_config` that built once on this machine is not built again by the next driver: its
checks and memory estimate read what the first one saved (config/model_facts.py), and a driver that
finds them imports neither torch nor transformers before its workers start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.config import load_config, model_check, model_facts
from elastictrain.config.model_check import model_problems
from elastictrain.driver.preflight import model_parts

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("ELASTICTRAIN_CACHE", str(folder))
    return folder


def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each build of a transformers config or of the model that the checks make."""
    made: list[str] = []
    build, structure = model_check._build, model_check._structure_problem
    monkeypatch.setattr(model_check, "_build", lambda c: made.append("config") or build(c))
    monkeypatch.setattr(model_check, "_structure_problem", lambda b: made.append("model") or structure(b))
    return made


def test_a_config_that_built_is_checked_from_what_its_first_check_saved(cache, monkeypatch):
    made = builds(monkeypatch)
    cfg = load_config(TINY, [])
    assert model_problems(cfg) == [] and made == ["config", "model"]
    assert model_problems(cfg) == [] and made == ["config", "model"]  # nothing built the second time
    # Another hf_config is another model: built.
    assert model_problems(load_config(TINY, ["model.hf_config.hidden_size=32"])) == []
    assert made == ["config", "model"] * 2


def test_a_check_that_reads_the_built_config_reads_the_saved_values(cache, monkeypatch, tmp_path):
    # Without max_position_embeddings in hf_config, transformers' default for llama (2048) bounds seq_len.
    preset = tmp_path / "preset.yaml"
    preset.write_text("".join(ln for ln in TINY.read_text().splitlines(True) if "max_position" not in ln))
    made = builds(monkeypatch)
    expected = [
        "data.seq_len: got 4096; expected <= 2048, the model.hf_config.max_position_embeddings "
        "(transformers' value for llama)"
    ]
    assert model_problems(load_config(preset, ["data.seq_len=4096"])) == expected
    assert model_problems(load_config(preset, ["data.seq_len=4096"])) == expected
    assert made == ["config", "model"]


def test_a_rejected_config_is_built_and_refused_every_time(cache, monkeypatch):
    made = builds(monkeypatch)
    cfg = load_config(TINY, ["model.hf_config.num_attention_heads=3"])
    first = model_problems(cfg)
    assert first and "model.hf_config" in first[0]
    assert model_problems(cfg) == first and made.count("config") == 2
    assert not list(cache.glob("model-facts/*.json")), "a refused config was saved"


def test_other_releases_of_transformers_or_torch_build_the_config_again(cache, monkeypatch):
    made = builds(monkeypatch)
    cfg = load_config(TINY, [])
    assert model_problems(cfg) == []
    monkeypatch.setattr(model_facts, "_version", lambda package: "0.0.1")
    assert model_problems(cfg) == [] and made == ["config", "model"] * 2


def test_the_memory_estimates_parameter_sizes_are_saved_as_computed(cache):
    cfg = load_config(TINY, [])
    computed = model_parts(cfg)
    (record,) = cache.glob("model-facts/*.json")
    assert json.loads(record.read_text())["parameter_sizes"] == computed[0]
    assert model_parts(cfg) == computed
    # LoRA and factory models are always built: only a plain hf_config is saved.
    assert model_facts.plain_hf_config(load_config(TINY, ["model.factory=mypkg:build"])) is None


def test_a_driver_that_finds_them_gets_to_its_workers_without_importing_torch_or_transformers(cache):
    """What a driver does before its workers start: the version check, the model and memory checks, and
    the import of the worker group (with the actor class Ray starts)."""
    script = (
        "import sys\n"
        "from elastictrain.compat.registry import refuse_unsupported_versions\n"
        "from elastictrain.config import load_config\n"
        "from elastictrain.driver.preflight import check_user_code, memory_estimate\n"
        "refuse_unsupported_versions()\n"
        f"cfg = load_config({str(TINY)!r}, [])\n"
        "check_user_code(cfg)\n"
        "memory_estimate(cfg, 2)\n"
        "import elastictrain.cluster.worker_group\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env = {**os.environ, "ELASTICTRAIN_CACHE": str(cache)}

    def imported() -> str:
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    # The first driver on this machine builds it (here this process, which has both imported already).
    cfg = load_config(TINY, [])
    assert model_problems(cfg) == [] and model_parts(cfg)
    assert imported() == "[]"
