"""Issue 36: the LoRA options LLaMA-Factory users set (all-linear targets, DoRA, rsLoRA, modules_to_save)
train under ZeRO-3 on 2 Ray workers, checkpoint, resume at another world size and export an adapter
peft loads. Real transformers and peft models, built here (nothing downloaded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, interrupt_after, quiet_reporter, run, tiny_config
from test_train_end_to_end import _losses
from typer.testing import CliRunner

from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.cli import app
from elastictrain.rundir.run_dir import RunDir

pytestmark = pytest.mark.integration

EXAMPLES = REPO / "examples"
# All four options at once: each adds trained tensors of its own kind (A and B on every linear layer,
# a magnitude vector per layer, a full copy of the head), all of which must reshard.
OPTIONS = (
    "model.lora.enabled=true",
    "model.lora.target_modules=all-linear",
    "model.lora.use_dora=true",
    "model.lora.use_rslora=true",
    "model.lora.modules_to_save=[lm_head]",
)


def checkpoint(run_dir: Path, step: int) -> FragmentReader:
    return FragmentReader(sorted((run_dir / "checkpoints" / f"step-{step:06d}").glob("*.safetensors")))


def test_lora_under_zero3_at_2_workers_resumes_at_3_and_continues_the_uninterrupted_run(ray_local, tmp_path):
    common = (*OPTIONS, "training.max_steps=8", "scaling.min_workers=2", "scaling.max_workers=2")
    reference, ref_dir, out = run(tiny_config(tmp_path / "ref", *common))
    assert reference.status.value == "FINISHED", out

    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(tmp_path / "stopped", *common), hook=interrupt_after(6))  # checkpoint at 4
    sizes = ["scaling.min_workers=3", "scaling.max_workers=3"]
    result = CliRunner().invoke(app, ["resume", str(tmp_path / "stopped"), *sizes])
    assert result.exit_code == 0, result.output
    stopped = RunDir.open(tmp_path / "stopped")
    info = stopped.read_info()
    assert info.status == "FINISHED" and info.last_step == 8
    assert [h["world_size"] for h in info.world_size_history] == [2, 3]
    assert [e["tag"] for e in stopped.read_events() if e["event"] == "resume"] == ["step-000004"]

    # Steps 5-8 ran at 3 workers (2 accumulated micro-batches of 2 per rank) instead of 2 (3 of 2): the
    # same samples, the same fp32 state from the checkpoint; only the order of fp32 sums differs, at
    # most a ~1e-7 relative effect per step that 4 Adam steps keep far below 1e-5 (as test_train_end_to_end.py
    # allows at the same world size). Training moves the loss by far more than that.
    ref, resumed = _losses(ref_dir), _losses(stopped)
    assert sorted(resumed) == list(range(1, 9))
    diffs = {step: abs(resumed[step] - ref[step]) / ref[step] for step in range(1, 9)}
    print("losses (reference, resumed, relative difference):")
    for step in range(1, 9):
        print(f"  step {step}: {ref[step]:.7f} {resumed[step]:.7f} {diffs[step]:.2e}")
    assert all(diffs[step] == 0 for step in range(1, 5)), diffs  # the same run up to the checkpoint
    assert max(diffs.values()) < 1e-5, diffs
    assert ref[8] < ref[4] - 1e-3  # the steps compared moved the loss

    # The state after the resume, tensor by tensor, is the uninterrupted run's; the kinds of tensors
    # each option adds are all there, and all moved.
    a, b, before = checkpoint(stopped.path, 8), checkpoint(ref_dir.path, 8), checkpoint(ref_dir.path, 4)
    assert set(a.params) == set(b.params)
    kinds = {"lora_A", "lora_B", "lora_magnitude_vector", "lm_head.modules_to_save"}
    assert all(any(k in n for k in kinds) for n in b.params)
    assert all(any(k in n for n in b.params) for k in kinds)
    worst = 0.0
    for name in b.params:
        x, y = a.full(name), b.full(name)
        moved = float((y - before.full(name)).norm() / y.norm())
        worst = max(worst, float((x - y).norm() / y.norm()))
        assert float((x - y).norm() / y.norm()) < 1e-4 < moved, name
    print(f"largest relative difference of a trained tensor at step 8: {worst:.2e}")
    check_adapter(stopped.path, a)


def check_adapter(run_dir: Path, last: FragmentReader, base: Any = None) -> None:
    """The run-end adapter holds every trained tensor of the last checkpoint and loads with peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from elastictrain.config import load_config
    from elastictrain.model.build import build_hf_config

    written = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    cfg = load_config(run_dir / "config.yaml")
    lora = cfg.model.lora
    assert (written["use_dora"], written["use_rslora"]) == (lora.use_dora, lora.use_rslora)
    assert written["modules_to_save"] == list(lora.modules_to_save)
    if base is None:
        base = AutoModelForCausalLM.from_config(build_hf_config(dict(cfg.model.hf_config)))
    params = dict(PeftModel.from_pretrained(base, run_dir / "adapter").named_parameters())
    for name in last.params:
        assert torch.equal(params[name].detach(), last.full(name)), name


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hf_causal_lm example's tokenizer and base model folders (no download)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from hf_causal_lm.prepare import prepare
    finally:
        sys.path.remove(str(EXAMPLES))
    root = tmp_path_factory.mktemp("hf-work")
    prepare(root)
    return root


def test_dora_reads_released_zero3_weights_as_zero2_holds_them(ray_local, base_model, tmp_path):
    """DoRA reads its base layer's weight outside that layer's forward (the norm of W + sBA): under
    ZeRO-3, with no parameter kept gathered (persistence threshold 0), it must see the real weight, so a
    ZeRO-3 run trains as a ZeRO-2 run (whole weights on every rank) does, with activation checkpointing
    recomputing the forward in the backward."""
    losses: dict[int, list[float]] = {2: [], 3: []}
    dirs = {}
    for stage in (3, 2):
        from elastictrain.chaos import record_losses
        from elastictrain.config import load_config
        from elastictrain.launch import prepare_run_dir, run_training

        cfg = load_config(
            EXAMPLES / "hf_causal_lm" / "lora.yaml",
            [
                f"run.dir={tmp_path / f'zero{stage}'}",
                f"model.pretrained={base_model / 'base-model'}",
                f"data.tokenizer={base_model / 'tokenizer'}",
                f"data.path={EXAMPLES / 'data' / 'sentences.jsonl'}",
                "model.lora.target_modules=all",
                "model.lora.use_dora=true",
                "model.lora.modules_to_save=[embed_tokens]",
                f"deepspeed.zero_stage={stage}",
                "deepspeed.extra.zero_optimization.stage3_param_persistence_threshold=0",
                "deepspeed.activation_checkpointing=true",
                "scaling.min_workers=2",
                "training.max_steps=4",
                "checkpoint.every_steps=4",
                "tracking.plots=false",
                "tracking.system_metrics=false",
            ],
        )
        run_dir, _ = prepare_run_dir(cfg, fresh=False)
        summary = run_training(
            cfg,
            run_dir,
            tracking=False,
            reporter=quiet_reporter(4),
            controller_hook=record_losses(losses[stage]),
        )
        assert summary.status.value == "FINISHED", summary.message
        dirs[stage] = run_dir.path
    print("losses ZeRO-3, ZeRO-2:", losses[3], losses[2])
    assert losses[3] == pytest.approx(losses[2], rel=1e-5)
    a, b = checkpoint(dirs[3], 4), checkpoint(dirs[2], 4)
    assert any("lora_magnitude_vector" in n for n in b.params)
    for name in b.params:
        x, y = a.full(name), b.full(name)
        assert float((x - y).norm() / y.norm()) < 1e-4, name

    from transformers import AutoModelForCausalLM

    check_adapter(dirs[3], a, AutoModelForCausalLM.from_pretrained(base_model / "base-model"))
