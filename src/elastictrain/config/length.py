"""How long a run trains: training.max_steps or training.num_epochs, warmup_steps or warmup_ratio.

Each pair is one setting given two ways: both in the same place (the YAML file, or the overrides) is an
error naming both; an override of one replaces the other given in the file (`-c conf/tiny-cpu.yaml
training.num_epochs=3` counts epochs). Epochs and the warmup ratio become fixed numbers when the run
starts (driver/launch.py `resolve_length`): the training set is counted, max_steps and warmup_steps
computed (core/run_length.py) and written to config.yaml, with epoch_samples, so that `resume RUN
training.num_epochs=N` recomputes max_steps here without the data. The warmup stays as first
computed: an extension does not move it.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from elastictrain.config.schema import Config, TrainingConfig
from elastictrain.core.run_length import steps_for_epochs

# (given instead, the step count it replaces)
PAIRS = (("num_epochs", "max_steps"), ("warmup_ratio", "warmup_steps"))


def _training(raw: dict[str, Any]) -> dict[str, Any]:
    section = raw.get("training")
    return section if isinstance(section, dict) else {}


def layer_length(
    cfg: Any, raw_file: dict[str, Any], raw_overrides: dict[str, Any], problems: list[str]
) -> None:
    """Check and settle the pairs on the merged OmegaConf `cfg` (load_config, after the merge)."""
    in_file, in_overrides = _training(raw_file), _training(raw_overrides)
    # A run's config.yaml holds num_epochs with the max_steps computed from it: not a conflict.
    written = in_file.get("epoch_samples") is not None
    for ratio, count in PAIRS:
        for layer, where in ((in_file, "the config file"), (in_overrides, "the overrides")):
            if layer.get(ratio) is None or count not in layer or (written and layer is in_file):
                continue
            problems.append(
                f"training.{ratio} and training.{count}: both set in {where} ({layer[ratio]!r} and "
                f"{layer[count]!r}); expected only one of them ({ratio} computes {count} when the run starts)"
            )
        if count in in_overrides and ratio not in in_overrides and in_file.get(ratio) is not None:
            OmegaConf.update(cfg, f"training.{ratio}", None)  # the override replaces the file's setting
            if ratio == "num_epochs":
                OmegaConf.update(cfg, "training.epoch_samples", None)
    t = cfg.training
    if t.num_epochs is not None and t.epoch_samples is not None and t.num_epochs > 0 and t.epoch_samples > 0:
        t.max_steps = steps_for_epochs(t.num_epochs, t.epoch_samples, max(1, t.global_batch_size))


def length_pending(t: TrainingConfig) -> bool:
    """max_steps or warmup_steps is still a placeholder, computed when the run starts."""
    return (t.num_epochs is not None and t.epoch_samples is None) or t.warmup_ratio is not None


def length_problems(config: Config) -> list[str]:
    t, p = config.training, []
    if t.num_epochs is not None and not t.num_epochs > 0:
        p.append(f"training.num_epochs: got {t.num_epochs}; expected a number > 0 (passes over the data)")
    if t.warmup_ratio is not None and not 0 <= t.warmup_ratio <= 1:
        p.append(f"training.warmup_ratio: got {t.warmup_ratio}; expected a share of the steps in [0, 1]")
    if t.epoch_samples is not None:
        if t.num_epochs is None:
            p.append(
                f"training.epoch_samples: got {t.epoch_samples} without training.num_epochs; it is written "
                "with num_epochs when a run starts (remove it)"
            )
        elif t.epoch_samples < 1:
            p.append(f"training.epoch_samples: got {t.epoch_samples}; expected >= 1 (leave it unset)")
    return p
