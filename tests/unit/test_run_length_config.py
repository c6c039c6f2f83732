"""training.num_epochs / max_steps and warmup_ratio / warmup_steps in the config (config/length.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.config import ConfigError, config_digest, load_config, to_flat_dict, to_yaml
from elastictrain.core.config_changes import classify_changes, extension_problem
from elastictrain.driver.launch import resolve_length

CONF = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"
# 11 generated samples of 64 bytes; eval.split holds out round(11 * 0.2) = 2 of them.
SMALL = ("data.generated_chars=704", "training.global_batch_size=4", "training.micro_batch_size=2")


def problems(*overrides: str, path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_both_set_in_one_place_is_an_error_naming_both(tmp_path):
    said = problems("training.num_epochs=3", "training.max_steps=10")
    assert "training.num_epochs and training.max_steps: both set in the overrides (3 and 10)" in said
    said = problems("training.warmup_ratio=0.1", "training.warmup_steps=2")
    assert "training.warmup_ratio and training.warmup_steps: both set" in said
    yaml = tmp_path / "both.yaml"
    yaml.write_text("training:\n  num_epochs: 2\n  max_steps: 10\n")
    assert "both set in the config file (2 and 10)" in problems(path=yaml)


def test_an_override_of_one_replaces_the_other_given_in_the_file(tmp_path):
    cfg = load_config(CONF, ["training.num_epochs=2", "training.warmup_ratio=0.1"])  # the file has steps
    assert (cfg.training.num_epochs, cfg.training.warmup_ratio) == (2, 0.1)
    yaml = tmp_path / "epochs.yaml"
    yaml.write_text("training:\n  num_epochs: 2\n  warmup_ratio: 0.1\n")
    cfg = load_config(yaml, ["training.max_steps=7", "training.warmup_steps=1"])
    assert (cfg.training.num_epochs, cfg.training.warmup_ratio, cfg.training.max_steps) == (None, None, 7)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("training.num_epochs=0", "training.num_epochs: got 0.0; expected a number > 0"),
        (
            "training.warmup_ratio=1.5",
            "training.warmup_ratio: got 1.5; expected a share of the steps in [0, 1]",
        ),
        ("training.epoch_samples=5", "training.epoch_samples: got 5 without training.num_epochs"),
    ],
)
def test_bad_values_name_the_field(override, expected):
    assert expected in problems(override)


def test_warmup_steps_beyond_the_placeholder_max_steps_wait_for_the_real_count():
    cfg = load_config(None, [*SMALL, "training.num_epochs=20", "training.warmup_steps=45"])
    resolve_length(cfg)  # no split: 11 samples x 20 / 4 = 55 steps
    assert (cfg.training.max_steps, cfg.training.warmup_steps) == (55, 45)


def test_start_counts_the_training_set_after_the_split_and_writes_fixed_numbers(tmp_path):
    cfg = load_config(
        None,
        [
            *SMALL,
            f"run.dir={tmp_path}",
            "eval.split=0.2",
            "training.num_epochs=3",
            "training.warmup_ratio=0.1",
        ],
    )
    lines = resolve_length(cfg)
    t = cfg.training
    # 9 training samples x 3 = 27 positions -> 7 steps of 4 (28: one sample of epoch 4 fills the last step)
    assert (t.epoch_samples, t.max_steps, t.warmup_steps, t.warmup_ratio) == (9, 7, 1, None)
    assert lines[0] == "eval.split=0.2 holds out 2 of 11 samples"
    assert "9 training samples x 3 / global batch 4 = 7 steps" in lines[1] and "with 1 sample(s)" in lines[1]
    assert "1 warmup steps of 7" in lines[2]
    written = tmp_path / "config.yaml"
    written.write_text(to_yaml(cfg))
    again = load_config(written)  # the run's config.yaml: num_epochs with its computed max_steps is fine
    assert again == cfg and config_digest(again) == config_digest(cfg)
    assert resolve_length(again) and again == cfg  # nothing left to count: the same numbers


def test_resuming_with_more_epochs_recomputes_max_steps_and_keeps_the_warmup(tmp_path):
    cfg = load_config(
        None, [*SMALL, f"run.dir={tmp_path}", "training.num_epochs=3", "training.warmup_ratio=0.1"]
    )
    resolve_length(cfg)
    written = tmp_path / "config.yaml"
    written.write_text(to_yaml(cfg))
    longer = load_config(written, ["training.num_epochs=5"])
    resolve_length(longer)
    assert (longer.training.max_steps, longer.training.warmup_steps) == (14, cfg.training.warmup_steps)
    changes = classify_changes(to_flat_dict(cfg), to_flat_dict(longer))
    assert not changes.refused
    assert changes.allowed == {"training.num_epochs": (3.0, 5.0), "training.max_steps": (9, 14)}
    said = extension_problem(9, 3, 1.0)
    assert said == "training.num_epochs: got 1 (3 steps); the run has already trained 9 steps (expected >= 9)"
    # Back to counting steps: the override replaces the epochs.
    steps = load_config(written, ["training.max_steps=20"])
    assert (steps.training.num_epochs, steps.training.epoch_samples, steps.training.max_steps) == (
        None,
        None,
        20,
    )
    assert not classify_changes(to_flat_dict(cfg), to_flat_dict(steps)).refused
