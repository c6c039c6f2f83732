"""The generated reference pages: every config key described, and the committed pages never stale."""

from __future__ import annotations

from readme_blocks import REPO

from elastictrain.cli import reference as cli_reference
from elastictrain.cli import reference_docs
from elastictrain.config import reference as config_reference


def test_every_config_key_and_section_has_a_description_in_the_schema():
    missing = config_reference.undescribed()
    assert not missing, (
        f"config keys without a description: {missing}; write one as a comment beside the key (or on the "
        "lines right above it) in src/elastictrain/config/schema.py, a section's as its class docstring"
    )


def test_the_config_reference_lists_every_key_with_its_type_and_default():
    text = config_reference.render()
    paths = [k.path for s in config_reference.sections() for k in s.keys]
    assert {"run.dir", "training.max_steps", "model.lora.r", "eval.data", "ray.num_cpus"} <= set(paths)
    assert "| `training.max_steps` | `int` | `40` | Optimizer steps of the run" in text
    assert "| `tracking.uri` | `str | None` | `null` |" in text
    assert "## model.lora" in text and "| `model.lora` |" not in text  # a section, not a key


def test_the_cli_reference_has_every_command_of_help_with_its_options():
    names = [c.name for c in cli_reference.commands()]
    assert {"train", "resume", "status", "export", "reshard", "build-ops"} <= set(names)
    text = cli_reference.render()
    for name in names:
        assert f"\n## {name}\n" in text
    assert "| `--world-size` (required) | int |" in text


def test_the_committed_reference_pages_are_what_the_generators_produce():
    stale = reference_docs.stale(REPO / "docs")
    assert not stale, f"docs/{', docs/'.join(stale)} are stale: run {reference_docs.REGENERATE}"
