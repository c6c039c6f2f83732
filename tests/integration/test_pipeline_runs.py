"""Runs whose replicas are pipelines (`scaling.pipeline_parallel`): the plain PyTorch loop's losses, a
checkpoint by transformers names that loads at another layout, and an export that is the reference model.

Real Ray workers hosting DeepSpeed's pipeline engine over gloo; the reference is
test_plain_pytorch_equivalence.py's single-process loop with its derived tolerances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import at_step, run
from reference import global_batch
from test_plain_pytorch_equivalence import STEPS, assert_same_losses, config, logged_losses, reference_for

from elastictrain.data.sources import dataset_from_config

pytestmark = pytest.mark.integration


def test_pipeline_replicas_train_the_plain_loss_resume_at_other_layouts_and_export_the_reference(
    ray_local, tmp_path
):
    """Tied input and output embeddings (Qwen2.5-0.5B and Llama 3.2 style): P 2 x D 2 (ZeRO-1) holds the
    one embedding on each replica's first stage (the input) and its last (the head), summing their
    gradients; stopped after step 6 (checkpoint at 4: one tensor for the pair, transformers names) it
    continues without pipelines at D 3, stopped after step 14 (checkpoint at 12) at P 2 x D 1 (ZeRO-0):
    every step's loss is the plain loop's; the export ties the pair again and is the reference model.
    (Untied stages: the pretrained, bf16 and node tests.)"""

    def stop(controller: object) -> None:
        raise KeyboardInterrupt

    steps = STEPS
    common = [f"training.max_steps={steps}", "checkpoint.every_steps=4"]

    def layout(stages: int, workers: int, zero: int = 1) -> object:
        return config(
            tmp_path / "run",
            True,
            *common,
            f"deepspeed.zero_stage={zero}",
            f"scaling.pipeline_parallel={stages}",
            f"scaling.min_workers={workers}",
            f"scaling.max_workers={workers}",
        )

    from elastictrain.driver.launch import apply_resume_changes
    from elastictrain.rundir.run_dir import RunDir

    def resumed_as(cfg: object) -> object:  # what `elastictrain resume RUN_DIR scaling...` does first
        apply_resume_changes(RunDir.open(tmp_path / "run"), cfg)
        return cfg

    with pytest.raises(KeyboardInterrupt):
        run(layout(2, 4), hook=at_step(6, stop))
    first = tmp_path / "run" / "checkpoints" / "step-000004"
    from elastictrain.checkpoint.zero_state import FragmentReader

    names = set(FragmentReader(sorted(first.glob("*.safetensors"))).params)
    assert "model.layers.1.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names, sorted(names)
    # No pipeline layer indices, no DeepSpeed tied-module names.
    assert not any(n.startswith("tied_modules") or n[0].isdigit() for n in names), sorted(names)

    with pytest.raises(KeyboardInterrupt):
        run(resumed_as(layout(1, 3)), hook=at_step(14, stop))
    cfg = resumed_as(layout(2, 2, zero=0))
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    assert "1 replica(s) of 2 pipeline stages" in output, output
    starts = [(e["world_size"], e["step"]) for e in run_dir.read_events() if e["event"] == "attempt_started"]
    assert starts == [(4, 0), (3, 4), (2, 12)], starts
    reference = reference_for(cfg)
    what = "tied, P 2 x D 2, then P 1 x D 3 from its checkpoint, then P 2 x D 1 from that one's"
    assert_same_losses(logged_losses(run_dir), reference.losses, reference.loss_tol, what)

    exported = _export_is_the_reference(run_dir, cfg, reference, tmp_path / "export")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight


def test_auto_chooses_the_stages_on_the_cluster_and_says_what_it_weighed(ray_local, tmp_path):
    """`pipeline_parallel: auto` on the local cluster: the start prints the choice and the runner-up with
    their estimates, the attempt trains at the chosen stages, and the choice is an event."""
    cfg = config(
        tmp_path / "run",
        False,
        "training.max_steps=3",
        "deepspeed.zero_stage=1",
        "scaling.pipeline_parallel=auto",
        "scaling.min_workers=2",
        "scaling.max_workers=2",
    )
    summary, run_dir, output = run(cfg, tracking=False)
    assert summary.status.value == "FINISHED", output
    chosen = [e for e in run_dir.read_events() if e["event"] == "pipeline_parallel"]
    assert len(chosen) == 1 and chosen[0]["world_size"] == 2, chosen
    stages = chosen[0]["pipeline_parallel"]
    assert f"scaling.pipeline_parallel=auto chose {stages} at 2 ranks: P {stages} x T 1" in output, output
    assert "runner-up P " in output and "s a step (compute" in output, output
    layout = "1 replica(s) of 2 pipeline stages" if stages == 2 else "x 2 ranks"
    assert layout in output, output


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_stages_of_a_pretrained_model_read_only_their_weights_and_train_as_one_rank_would(
    ray_local, tmp_path, tied
):
    """A pretrained folder (a Llama saved with save_pretrained here; tied: no lm_head tensor, the last
    stage's head reads the embedding): each stage builds the model on the meta device and reads only its
    own layers' tensors; P 2 x D 1 reports the training and validation losses of D 2 without pipelines
    within the summation noise (8.7e-6 is this model's derived tolerance), and generates the same
    completions of eval.prompts at each validation."""
    folder = _pretrained_llama(tmp_path / "pretrained", tied)
    prompts = ('eval.prompts=["The ", "A quick brown fox"]', "eval.max_new_tokens=12")
    validated = ("eval.split=0.1", "eval.steps=2", "eval.every_steps=3", *prompts)
    runs = [
        _run(tmp_path, p, "training.max_steps=6", f"model.pretrained={folder}", *validated) for p in (2, 1)
    ]
    staged, whole = (logged_losses(r) for r in runs)
    assert len(staged) == len(whole) == 6
    worst = max(abs(a - b) for a, b in zip(staged, whole, strict=True))
    assert worst <= 1e-5, (staged, whole)
    # Validation runs through the stages (DeepSpeed's forward-only schedule): the same losses.
    staged_eval, whole_eval = (_eval_losses(r) for r in runs)
    assert sorted(staged_eval) == sorted(whole_eval) == [3, 6], (staged_eval, whole_eval)
    assert all(abs(staged_eval[k] - whole_eval[k]) <= 1e-5 for k in whole_eval), (staged_eval, whole_eval)
    # Generation at validation: each new token one forward through the stages, greedy as generate() is.
    staged_said, whole_said = (_completions(r) for r in runs)
    assert sorted(whole_said) == [3, 6] and staged_said == whole_said, (staged_said, whole_said)
    assert all(len(c) == 2 and all(text for text in c) for c in whole_said.values()), whole_said
    from elastictrain.checkpoint.zero_state import FragmentReader

    saved = FragmentReader(sorted((tmp_path / "run-p2" / "checkpoints").glob("step-*/*.safetensors"))).params
    assert ("lm_head.weight" in saved) is not tied and "model.embed_tokens.weight" in saved, sorted(saved)


def test_lora_adapters_train_through_stages_as_without_them_and_resume_across_layouts(ray_local, tmp_path):
    """LoRA (all-linear) on a tied pretrained Llama: D 2 without stages stopped after step 5 continues at
    P 2 x D 1 from its checkpoint at 4; its losses are those of a P 2 x D 1 run from the start within the
    summation noise (steps 1-4: the adapters start the same built whole or stage by stage), both
    checkpoints hold the same adapter tensors under peft's names and nothing of the frozen base, and the
    adapters the two runs write at their end agree. Each stage reads its frozen base weights from the
    folder (the last its head from the tied embedding)."""
    from safetensors.torch import load_file

    from elastictrain.checkpoint.zero_state import FragmentReader
    from elastictrain.driver.launch import apply_resume_changes
    from elastictrain.rundir.run_dir import RunDir

    folder = _pretrained_llama(tmp_path / "pretrained", tied=True)
    lora = ("model.lora.enabled=true", "model.lora.target_modules=all-linear", "model.lora.r=4")
    common = (f"model.pretrained={folder}", *lora, "training.max_steps=6", "checkpoint.every_steps=2")

    def layout(stages: int) -> Any:
        stage = f"scaling.pipeline_parallel={stages}"
        return config(tmp_path / "run", False, "deepspeed.zero_stage=1", stage, *common)

    def stop(controller: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(layout(1), hook=at_step(5, stop))
    resumed = layout(2)
    apply_resume_changes(RunDir.open(tmp_path / "run"), resumed)
    summary, run_dir, output = run(resumed)
    assert summary.status.value == "FINISHED", output
    assert "1 replica(s) of 2 pipeline stages" in output, output
    starts = [(e["world_size"], e["step"]) for e in run_dir.read_events() if e["event"] == "attempt_started"]
    assert starts == [(2, 0), (2, 4)], starts
    staged = _run(tmp_path, 2, *common)

    def saved(r: Any) -> set[str]:
        return set(FragmentReader(sorted((r.path / "checkpoints/step-000004").glob("*.safetensors"))).params)

    names = saved(staged)
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight" in names, sorted(names)
    assert len(names) == 28 and all(".lora_" in n for n in names) and names == saved(run_dir), sorted(names)
    mixed_losses, staged_losses = logged_losses(run_dir), logged_losses(staged)
    assert len(mixed_losses) == len(staged_losses) == 6
    worst = max(abs(a - b) for a, b in zip(mixed_losses, staged_losses, strict=True))
    assert worst <= 1e-5, (mixed_losses, staged_losses)
    mixed, alone = (load_file(r.path / "adapter" / "adapter_model.safetensors") for r in (run_dir, staged))
    assert mixed.keys() == alone.keys() and len(alone) == 28
    worst = max((mixed[k] - alone[k]).abs().max().item() for k in alone)
    assert worst <= 1e-4, worst


def _pretrained_llama(folder: Path, tied: bool) -> Path:
    """A small Llama saved with save_pretrained (tied: no lm_head tensor in the folder)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    AutoModelForCausalLM.from_config(hf).save_pretrained(folder)
    return folder


def test_bf16_stages_train_the_losses_of_bf16_without_stages_within_its_rounding(ray_local, tmp_path):
    """bf16 (DeepSpeed's bf16 optimizer under ZeRO-1) at P 2 x D 1 and at D 2 without stages: the same
    losses within one bf16 rounding of the loss (2^-8 of it; measured here about 2e-5 of it)."""

    staged, whole = (_losses(tmp_path, p, "training.max_steps=4", "training.precision=bf16") for p in (2, 1))
    assert len(staged) == len(whole) == 4
    assert all(abs(a - b) <= 2**-8 * abs(b) for a, b in zip(staged, whole, strict=True)), (staged, whole)


def _export_is_the_reference(run_dir: Any, cfg: Any, reference: Any, out: Path) -> Any:
    """`elastictrain export` of the finished run loads with from_pretrained and gives the reference
    model's logits (after STEPS steps) within their tolerance; the exported model."""
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from elastictrain.cli import app

    result = CliRunner().invoke(app, ["export", str(run_dir.path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = global_batch(cfg, dataset_from_config(cfg), STEPS)[:4]
    want, logits_tol = reference.logits_and_tolerance(ids)
    with torch.no_grad():
        diff = (exported(input_ids=ids).logits - want).abs().max().item()
    assert diff <= logits_tol, f"export vs reference after {STEPS} steps: {diff:.2e} > {logits_tol:.2e}"
    return exported


def _losses(tmp_path: Path, stages: int, *overrides: str) -> list[float]:
    """Each step's loss of a finished ZeRO-1 run at `stages` pipeline stages (two workers)."""
    return logged_losses(_run(tmp_path, stages, *overrides))


def _eval_losses(run_dir: Any) -> dict[int, float]:
    """The run's validation losses by step, as MLflow holds them."""
    from mlflow.tracking import MlflowClient

    from elastictrain.tracking.tracker import resolve_tracking_uri

    info = run_dir.read_info()
    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, run_dir.path))
    return {m.step: m.value for m in client.get_metric_history(info.mlflow_run_id, "eval_loss")}


def _completions(run_dir: Any) -> dict[int, list[str]]:
    """The completions of eval.prompts each validation recorded, by step (rank 0's, every rank agreeing)."""
    said = [e for e in run_dir.read_events() if e["event"] == "completions"]
    assert all(e["ranks_agree"] for e in said), said
    return {e["step"]: [c["completion"] for c in e["completions"]] for e in said}


def _run(tmp_path: Path, stages: int, *overrides: str) -> Any:
    """A finished ZeRO-1 run at `stages` pipeline stages (two workers): its folder."""
    cfg = config(
        tmp_path / f"run-p{stages}",
        False,
        "deepspeed.zero_stage=1",
        f"scaling.pipeline_parallel={stages}",
        *overrides,
    )
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    return run_dir
