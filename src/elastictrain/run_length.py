"""training.num_epochs and warmup_ratio become fixed step counts when a run starts (config/length.py: how
the loader treats the pairs). Counts the training set here, on the driver, before any worker exists."""

from __future__ import annotations

from elastictrain.config import Config, validate
from elastictrain.core.epochs import epoch_length, warmup_for_ratio


def training_samples(config: Config) -> tuple[int, int]:
    """(samples training reads, samples held out for validation by eval.split), counted on this process."""
    from elastictrain.data.eval_data import train_and_eval_datasets

    train, held = train_and_eval_datasets(config)
    return len(train), (len(held) if held is not None and config.eval.data is None else 0)


def resolve_length(config: Config) -> list[str]:
    """Turn num_epochs and warmup_ratio into max_steps and warmup_steps, in place; what was computed.

    Counts the training set when num_epochs has no epoch_samples yet (builds the dataset here). Call it
    before the run folder is made or resumed, so that config.yaml and its digest hold the numbers.
    """
    t, lines = config.training, []
    if t.num_epochs is not None:
        if t.epoch_samples is None:
            samples, held = training_samples(config)
            t.epoch_samples = samples
            if held:
                lines.append(f"eval.split={config.eval.split:g} holds out {held} of {samples + held} samples")
        length = epoch_length(t.num_epochs, t.epoch_samples, t.global_batch_size)
        t.max_steps = length.steps
        lines.append(length.describe())
    if t.warmup_ratio is not None:
        t.warmup_steps = warmup_for_ratio(t.warmup_ratio, t.max_steps)
        lines.append(
            f"training.warmup_ratio={t.warmup_ratio:g}: {t.warmup_steps} warmup steps of {t.max_steps} "
            "(training.warmup_steps, rounded up; kept if the run is extended)"
        )
        t.warmup_ratio = None  # now a fixed number: config.yaml holds warmup_steps alone
    if lines:  # warmup_steps against the computed max_steps, and the rest as before
        validate(config)
    return lines
