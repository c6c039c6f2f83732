"""Which config changes `elastictrain resume RUN_DIR key=value` may take (pure rules)."""

from __future__ import annotations

from elastictrain.core.config_changes import classify_changes, extension_problem

BASE = {
    "model.hf_config.hidden_size": 64,
    "training.max_steps": 40,
    "training.global_batch_size": 24,
    "training.micro_batch_size": 4,
    "training.seed": 42,
    "training.lr": 0.003,
    "data.seq_len": 64,
    "scaling.max_workers": 2,
    "checkpoint.every_steps": 10,
    "deepspeed.zero_stage": 3,
    "deepspeed.config_file": None,
}


def test_extending_a_run_and_changing_how_it_runs_are_allowed():
    after = {
        **BASE,
        "training.max_steps": 80,
        "scaling.max_workers": 3,
        "checkpoint.every_steps": 5,
        "deepspeed.zero_stage": 2,
        "training.micro_batch_size": 2,
    }
    changes = classify_changes(BASE, after)
    assert not changes.refused
    assert changes.allowed["training.max_steps"] == (40, 80)
    assert set(changes.allowed) == {
        "training.max_steps",
        "scaling.max_workers",
        "checkpoint.every_steps",
        "deepspeed.zero_stage",
        "training.micro_batch_size",
    }


def test_model_shape_global_batch_data_order_and_optimizer_changes_are_refused_naming_the_key():
    after = {
        **BASE,
        "model.hf_config.hidden_size": 128,
        "training.global_batch_size": 48,
        "training.seed": 7,
        "data.seq_len": 128,
        "training.lr": 0.1,
        "deepspeed.config_file": "ds.json",
    }
    changes = classify_changes(BASE, after)
    assert not changes.allowed
    assert changes.refused == {
        "data.seq_len": "the data and its order",
        "deepspeed.config_file": "what the optimizer computes",
        "model.hf_config.hidden_size": "the model's shape and weights",
        "training.global_batch_size": "the global batch",
        "training.lr": "what the optimizer computes",
        "training.seed": "the data order",
    }
    assert "model.hf_config.hidden_size: cannot change when resuming; it changes the model's shape" in (
        changes.refusal()
    )


def test_a_key_that_appears_or_disappears_counts_as_a_change():
    changes = classify_changes(BASE, {**BASE, "model.hf_config.rope_theta": 1e6})
    assert changes.refused == {"model.hf_config.rope_theta": "the model's shape and weights"}


def test_shortening_below_the_steps_already_trained_is_refused():
    assert extension_problem(40, 80) is None and extension_problem(40, 40) is None
    assert "already trained 40 steps (expected >= 40)" in (extension_problem(40, 30) or "")


def test_precision_may_change_between_fp32_and_bf16_only():
    # Checkpoints hold fp32 master weights and optimizer state whatever the precision (a run moved from
    # a CPU in fp32 to a GPU in bf16 and back: tests/integration/test_gpu_checkpoint_on_cpu.py).
    for old, new in (("fp32", "bf16"), ("bf16", "fp32")):
        changes = classify_changes({**BASE, "training.precision": old}, {**BASE, "training.precision": new})
        assert changes.allowed == {"training.precision": (old, new)} and not changes.refused
    for old, new in (("fp32", "fp16"), ("fp16", "bf16")):  # fp16 carries a loss scale the others lack
        changes = classify_changes({**BASE, "training.precision": old}, {**BASE, "training.precision": new})
        assert not changes.allowed
        assert "training.precision: cannot change when resuming; it changes fp16's loss scale" in (
            changes.refusal()
        )


def test_a_preference_setting_is_refused_on_resume_naming_the_loss():
    changes = classify_changes({"preference.beta": 0.1}, {"preference.beta": 0.5})
    assert changes.refused == {
        "preference.beta": "the preference loss, and what the kept reference log-probabilities mean"
    }
    assert classify_changes({"training.objective": "lm"}, {"training.objective": "dpo"}).refused
