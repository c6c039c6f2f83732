"""Issue 58 point 7: a DPO run exports as supervised fine-tuning does, and the export learned the pairs.

A pretrained folder (a Llama saved with save_pretrained beside a ChatML tokenizer trained in the test) is
fine-tuned with DPO for one epoch of 64 LLaMA-Factory ranking pairs at 2 Ray workers, ZeRO-3: once with
LoRA (the reference: adapters off), exported with --merge-lora; once in full (the reference pass),
exported as it is. Each export loads with transformers alone, and its implicit reward margin on those
pairs (its log-ratio to the starting model, chosen minus rejected, summed over each answer's tokens) is
positive on average and on most pairs, where the starting model's own is 0 by definition.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run, tiny_config
from test_export_pretrained import export, loaded

from elastictrain.data.sources import dataset_from_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a pretrained folder with its ChatML tokenizer, a data folder of 64 ranking pairs)."""
    from preference_fixtures import write_pairs
    from sft_fixtures import make_chatml_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("dpo-export")
    folder = make_chatml_tokenizer(root / "base")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder, write_pairs(root / "data", 64)


def dpo_run(tmp: Path, base: tuple[Path, Path], *extra: str) -> tuple[Path, object]:
    folder, data = base
    cfg = tiny_config(
        tmp / "run",
        f"model.pretrained={folder}",
        "data.source=sft",
        f"data.dataset_dir={data}",
        "data.dataset=pairs",
        "data.seq_len=64",
        "training.objective=dpo",
        "training.max_steps=8",  # one epoch
        "training.global_batch_size=8",
        "training.micro_batch_size=4",
        "training.warmup_steps=1",
        "training.lr=1e-2",
        "checkpoint.every_steps=8",
        "scaling.min_workers=2",
        "scaling.max_workers=2",
        *extra,
    )
    summary, run_dir, out = run(cfg, tracking=False)
    assert summary.status.value == "FINISHED", out
    assert summary.step == 8, "one epoch of 64 pairs at 8 a step"
    return run_dir.path, cfg


def margins(model: torch.nn.Module, starting: torch.nn.Module, dataset) -> torch.Tensor:  # noqa: ANN001
    """Each pair's implicit reward margin of `model` against `starting`."""

    def logps(m: torch.nn.Module, ids: list[int], answer: int) -> float:
        with torch.no_grad():
            logits = m(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return float(picked[-answer:].sum())

    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        chosen, rejected = item["prompt"] + item["first"], item["prompt"] + item["second"]
        nc, nr = len(item["first"]), len(item["second"])
        ratio_c = logps(model, chosen, nc) - logps(starting, chosen, nc)
        ratio_r = logps(model, rejected, nr) - logps(starting, rejected, nr)
        out.append(ratio_c - ratio_r)
    return torch.tensor(out)


@pytest.mark.parametrize("kind", ["lora-merged", "full"])
def test_a_dpo_export_loads_and_prefers_the_chosen_answers_more_than_the_starting_model(
    ray_local, tmp_path, base, kind
):
    lora = ("model.lora.enabled=true", "model.lora.target_modules=all-linear", "model.lora.r=8")
    run_dir, cfg = dpo_run(tmp_path, base, *(lora if kind == "lora-merged" else ()))
    output = export(run_dir, tmp_path / "hf", *(("--merge-lora",) if kind == "lora-merged" else ()))
    assert "check:" in output, output
    exported, starting = loaded(tmp_path / "hf"), loaded(base[0])
    found = margins(exported, starting, dataset_from_config(cfg))
    share = float((found > 0).float().mean())
    print(f"\n{kind}: implicit reward margin mean {found.mean():.3f}, positive on {share:.0%} of pairs")
    assert found.mean() > 0.5, f"mean margin {found.mean():.3f}"
    assert share > 0.75, f"positive on {share:.0%} of the pairs"
