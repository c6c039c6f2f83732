"""Validation: its config, the held-out split, when it runs, and what the control loop records of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from loop_harness import make_run

from elastictrain.config import ConfigError, load_config
from elastictrain.core.batch import plan_batch
from elastictrain.core.config_changes import classify_changes
from elastictrain.core.data_order import eval_positions, held_out
from elastictrain.core.losses import eval_due, eval_summary


def test_held_out_samples_are_a_fixed_seeded_fraction_that_training_never_gets():
    train, held = held_out(1000, 0.05, seed=7)
    assert len(held) == 50 and len(train) == 950
    assert not set(train) & set(held) and set(train) | set(held) == set(range(1000))
    assert held_out(1000, 0.05, seed=7) == (train, held)  # the same at every start
    assert held_out(1000, 0.05, seed=8)[1] != held
    assert held_out(10, 0.0, seed=7) == (tuple(range(10)), ())
    assert len(held_out(10, 0.001, seed=7)[1]) == 1  # a fraction > 0 holds out at least one sample


def test_every_validation_sample_is_read_once_per_batch_at_any_world_size():
    for world in (1, 2, 3):
        plan = plan_batch(12, 2, world)
        assert plan is not None
        read = sorted(
            i
            for rank in range(world)
            for micro in range(plan.grad_accum_steps)
            for i in eval_positions(1, plan, rank, micro, num_samples=100)
        )
        assert read == list(range(12, 24))
    plan = plan_batch(12, 4, 1)
    assert plan is not None
    assert eval_positions(2, plan, 0, 0, num_samples=30) == [24, 25, 26, 27]
    assert eval_positions(2, plan, 0, 2, num_samples=30) == [2, 3, 4, 5]  # wraps around a small set


def test_validation_runs_every_n_steps_and_at_the_end():
    assert [s for s in range(1, 13) if eval_due(s, every=5, max_steps=12)] == [5, 10, 12]
    assert [s for s in range(1, 13) if eval_due(s, every=0, max_steps=12)] == [12]


def test_eval_summary_is_per_target_token_over_all_ranks():
    ranks = [
        {"loss_sum": 30.0, "target_tokens": 10, "samples": 2},
        {"loss_sum": 10.0, "target_tokens": 30, "samples": 2},
    ]
    s = eval_summary(ranks)
    assert s["eval_loss"] == pytest.approx(1.0) and s["eval_tokens"] == 40 and s["eval_samples"] == 4
    assert s["eval_perplexity"] == pytest.approx(2.718281828)
    own = eval_summary([{"loss_sum": 6.0, "target_tokens": None, "samples": 3}])  # a loss of your own
    assert own["eval_loss"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.steps=2"], "eval.steps: got 2 but no validation set; set eval.split"),
        (["eval.split=1.0", "eval.steps=1"], "eval.split: got 1.0; expected a fraction of the training data"),
        (["eval.every_steps=-1"], "eval.every_steps: got -1; expected >= 0"),
        (["eval.split=0.1", "eval.data.path=x"], "eval.split: got 0.1 and eval.data is set"),
        (["eval.data.source=file", "eval.data.path=/nope.txt"], "eval.data.path: got '/nope.txt'"),
        (["eval.data.seq_len=32"], "eval.data.seq_len: got 32; expected data.seq_len (64)"),
        (["eval.data.pth=x"], "unknown key 'eval.data.pth'; did you mean 'eval.data.path'?"),
    ],
)
def test_bad_validation_settings_name_the_field_and_what_would_be_valid(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_eval_data_inherits_the_training_data_options_it_does_not_set(tmp_path: Path):
    text = tmp_path / "val.txt"
    text.write_text("validation text " * 100)
    cfg = load_config(
        None, ["data.seq_len=32", "eval.steps=1", "eval.data.source=file", f"eval.data.path={text}"]
    )
    assert cfg.eval.data is not None
    assert (cfg.eval.data.source, cfg.eval.data.path, cfg.eval.data.seq_len) == ("file", str(text), 32)


def test_a_resume_may_change_how_often_it_validates_but_not_the_held_out_split():
    changes = classify_changes(
        {"eval.every_steps": 5, "eval.steps": 1, "eval.split": 0.1},
        {"eval.every_steps": 2, "eval.steps": 4, "eval.split": 0.2},
    )
    assert set(changes.allowed) == {"eval.every_steps", "eval.steps"}
    assert "eval.split: cannot change when resuming" in changes.refusal()


def test_the_loop_validates_every_n_steps_and_at_the_end_and_records_it_everywhere(tmp_path: Path):
    r = make_run(tmp_path, "eval.split=0.1", "eval.steps=1", "eval.every_steps=5")
    workers: list = []
    r.controller.callbacks.after_attempt_start.append(lambda c: workers.extend(c.active))
    assert r.run().status.value == "FINISHED"
    evals = r.events("eval")
    assert [e["step"] for e in evals] == [5, 10, 12]
    assert [e["eval_loss"] for e in evals] == pytest.approx([1 / 5, 1 / 10, 1 / 12])  # the fake: 1/steps
    assert "eval at step 12: loss 0.0833, perplexity 1.09 (60 tokens" in r.terminal.getvalue()
    info = r.run_dir.read_info()
    assert info.extra["last_eval"]["step"] == 12 and info.extra["best_eval"]["step"] == 12
    assert [w.calls.count("evaluate") for w in workers] == [3, 3]  # every rank evaluates its share


def test_a_validation_repeated_after_a_restart_is_recorded_once(tmp_path: Path):
    r = make_run(tmp_path, "eval.split=0.1", "eval.steps=1", "eval.every_steps=2")
    r.group.die_at_step(rank=1, step=6)  # steps 4 and 5 are redone from the step-4 checkpoint
    assert r.run().status.value == "FINISHED"
    assert [e["step"] for e in r.events("eval")] == [2, 4, 6, 8, 10, 12]


def test_without_a_validation_set_no_rank_is_asked_to_evaluate(tmp_path: Path):
    r = make_run(tmp_path)
    workers: list = []
    r.controller.callbacks.after_attempt_start.append(lambda c: workers.extend(c.active))
    r.run()
    assert workers and not r.events("eval") and all("evaluate" not in w.calls for w in workers)


def test_keep_best_keeps_the_checkpoint_of_the_lowest_validation_loss_out_of_pruning(tmp_path: Path):
    args = ("eval.split=0.1", "eval.steps=1", "eval.every_steps=4", "checkpoint.keep_last=1")
    r = make_run(tmp_path / "best", *args, "checkpoint.keep_best=true")
    r.group.eval_loss_at = {4: 2.0, 8: 1.0, 12: 3.0}  # overfitting after step 8
    assert r.run().status.value == "FINISHED"
    assert sorted(p.name for p in r.run_dir.checkpoints_dir.glob("step-*")) == ["step-000008", "step-000012"]
    assert r.run_dir.read_info().extra["best_eval"]["step"] == 8
    plain = make_run(tmp_path / "plain", *args)
    plain.group.eval_loss_at = {4: 2.0, 8: 1.0, 12: 3.0}
    plain.run()
    assert sorted(p.name for p in plain.run_dir.checkpoints_dir.glob("step-*")) == ["step-000012"]
