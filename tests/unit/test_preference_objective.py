"""Preference objectives inside the step (model/objective.py), their rows (data/preference/dataset.py), the
config checks (config/objective_check.py), the reference table (data/preference/reference.py) and the
global-batch figures (core/losses.py), on a real transformers Llama and records made here."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastictrain.config import ConfigError, load_config
from elastictrain.core.losses import eval_summary, preference_figures, step_loss
from elastictrain.core.objectives import reference_kind
from elastictrain.data.preference import reference as store
from elastictrain.data.preference.dataset import PreferenceRows, collate_rows
from elastictrain.data.preference.encode import EncodedKto, EncodedPair
from elastictrain.model.loss import IGNORE_INDEX
from elastictrain.model.objective import PreferenceObjective, disable_dropout

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def pairs() -> PreferenceRows:
    g = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 64, (n,), generator=g).tolist()

    items = [EncodedPair(ids(4 + i), ids(2 + i), ids(5 - i)) for i in range(3)]
    return PreferenceRows(items, report=None, pad_token_id=0, kto=False)  # type: ignore[arg-type]


def kto_rows() -> PreferenceRows:
    items = [
        EncodedKto([1, 2, 3], [4, 5], True),
        EncodedKto([6, 7], [8, 9, 10], False),
        EncodedKto([11], [12], True),
    ]
    return PreferenceRows(items, report=None, pad_token_id=0, kto=True)  # type: ignore[arg-type]


def alone_logps(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> tuple[float, int]:
    """One row, no padding: the answer tokens' summed log-probability, computed token by token."""
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    total = sum(float(logprobs[len(prompt) + k - 1, t]) for k, t in enumerate(answer))
    return total, len(answer)


# ---------------------------------------------------------------- rows
def test_rows_hold_every_first_answer_then_every_second_with_labels_only_on_answers():
    rows = pairs()
    batch = collate_rows([rows[i] for i in range(3)], pad_id=0)
    assert batch["input_ids"].shape[0] == 6
    for i in range(3):
        item = rows.items[i]
        for r, answer in ((i, item.chosen_ids), (i + 3, item.rejected_ids)):
            n = len(item.prompt_ids) + len(answer)
            assert batch["input_ids"][r, :n].tolist() == item.prompt_ids + answer
            labels = batch["labels"][r].tolist()
            assert labels[: len(item.prompt_ids)] == [IGNORE_INDEX] * len(item.prompt_ids)
            assert labels[len(item.prompt_ids) : n] == answer
            assert set(labels[n:]) <= {IGNORE_INDEX} and batch["attention_mask"][r].sum() == n


def test_a_kto_record_s_second_row_is_its_prompt_with_the_next_record_s_answer_wrapping():
    rows = kto_rows()
    assert rows.rows(0) == ([1, 2, 3], [4, 5], [8, 9, 10])
    assert rows.rows(2) == ([11], [12], [4, 5])
    batch = rows.collate([rows[i] for i in range(3)])
    assert batch["desirable"].tolist() == [True, False, True]


# ---------------------------------------------------------------- losses of the objective
def objective(name: str, **kw: Any) -> PreferenceObjective:
    return PreferenceObjective(name=name, reference=kw.pop("reference", "precomputed"), **kw)


def with_reference(rows: PreferenceRows, model: torch.nn.Module, scale: float = 0.9) -> dict[str, Any]:
    """The rows' batch with a reference table (a shifted copy of the model's own log-probabilities)."""
    table = []
    for i in range(len(rows)):
        prompt, first, second = rows.rows(i)
        table.append([alone_logps(model, prompt, first)[0] * scale, alone_logps(model, prompt, second)[0]])
    ref = torch.tensor(table)
    rows.reference = ref.float()
    return rows.collate([rows[i] for i in range(len(rows))])


CASES = [
    ("dpo", {"dpo_loss": "sigmoid", "beta": 0.2, "label_smoothing": 0.1, "ftx": 0.5}),
    ("dpo", {"dpo_loss": "hinge", "beta": 0.3}),
    ("dpo", {"dpo_loss": "ipo", "beta": 0.4}),
    ("simpo", {"beta": 2.0, "simpo_gamma": 0.7, "reference": "none"}),
    ("orpo", {"beta": 0.25, "ftx": 0.3, "reference": "none"}),
]


@pytest.mark.parametrize(
    ("name", "kw"), CASES, ids=["dpo-sigmoid-ls-ftx", "hinge", "ipo", "simpo", "orpo-ftx"]
)
def test_each_pair_objective_is_its_formula_on_every_pair_alone(model, name, kw):
    rows = pairs()
    batch = with_reference(rows, model)
    obj = objective(name, **kw)
    with torch.no_grad():
        terms = obj.terms(model, batch)
    for i in range(3):
        prompt, chosen, rejected = rows.rows(i)
        c, nc = alone_logps(model, prompt, chosen)
        r, nr = alone_logps(model, prompt, rejected)
        rc, rr = float(rows.reference[i, 0]), float(rows.reference[i, 1])
        b = kw["beta"]
        if name == "dpo" and kw["dpo_loss"] == "sigmoid":
            m = b * ((c - rc) - (r - rr))
            ls = kw["label_smoothing"]
            want = -math.log(1 / (1 + math.exp(-m))) * (1 - ls) - math.log(1 / (1 + math.exp(m))) * ls
        elif name == "dpo" and kw["dpo_loss"] == "hinge":
            want = max(0.0, 1 - b * ((c - rc) - (r - rr)))
        elif name == "dpo":
            want = (((c - rc) / nc - (r - rr) / nr) - 1 / (2 * b)) ** 2
        elif name == "simpo":
            z = b * (c / nc - r / nr) - kw["simpo_gamma"]
            want = -math.log(1 / (1 + math.exp(-z)))
        else:
            mc, mr = c / nc, r / nr
            odds = (mc - mr) - (math.log1p(-math.exp(mc)) - math.log1p(-math.exp(mr)))
            want = -mc - b * math.log(1 / (1 + math.exp(-odds)))
        want += kw.get("ftx", 0.0) * (-c / nc)  # the SFT term, on top of any objective's own
        assert float(terms.losses[i]) == pytest.approx(want, rel=2e-4, abs=2e-5), (name, i)
    assert set(terms.stats) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    }
    assert all(float(n) == 3 for _, n in terms.stats.values())


def test_kto_is_its_formula_with_the_kl_estimate_given_and_figures_split_by_label(model):
    rows = kto_rows()
    batch = with_reference(rows, model, scale=1.1)
    obj = objective("kto", beta=0.3, kto_desirable_weight=1.5, kto_undesirable_weight=0.5, ftx=0.2)
    kl = obj.kl_sum(model, batch) / 3
    want_kl = sum(
        alone_logps(model, rows.rows(i)[0], rows.rows(i)[2])[0] - float(rows.reference[i, 1])
        for i in range(3)
    )
    assert float(kl) == pytest.approx(want_kl / 3, rel=2e-4, abs=1e-4)
    with torch.no_grad():
        terms = obj.terms(model, batch, kl)
    z = max(float(kl), 0.0)
    for i, good in enumerate((True, False, True)):
        logp, n = alone_logps(model, *rows.rows(i)[:2])
        ratio = logp - float(rows.reference[i, 0])
        sig = 1 / (1 + math.exp(-0.3 * ((ratio - z) if good else (z - ratio))))
        want = (1.5 if good else 0.5) * (1 - sig) + (0.2 * -logp / n if good else 0.0)
        assert float(terms.losses[i]) == pytest.approx(want, rel=2e-4, abs=2e-5)
    assert float(terms.stats["rewards/chosen"][1]) == 2 and float(terms.stats["rewards/rejected"][1]) == 1


def test_a_lora_reference_is_the_model_with_its_adapters_off_and_dpo_starts_at_ln_2(model):
    import copy

    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    rows = pairs()
    batch = rows.collate([rows[i] for i in range(3)])
    obj = objective("dpo", reference="adapters")
    with torch.no_grad():
        terms = obj.terms(wrapped, batch)
    assert terms.losses.tolist() == pytest.approx([math.log(2)] * 3, abs=1e-7)


def test_dropout_is_turned_off_in_every_module():
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout(0.1))
    )
    assert disable_dropout(net) == 2
    assert all(m.p == 0 for m in net.modules() if isinstance(m, torch.nn.Dropout))


def test_the_reference_by_objective_and_model():
    assert reference_kind("dpo", "auto", lora=True) == "adapters"
    assert reference_kind("kto", "auto", lora=False) == "precomputed"
    assert reference_kind("orpo", "precomputed", lora=False) == "none"
    assert reference_kind("simpo", "auto", lora=True) == "none"


# ---------------------------------------------------------------- the global batch's figures
def test_a_step_s_loss_and_figures_are_means_over_every_rank_s_items():
    ranks = [
        {"rank": 0, "loss": 0.5, "loss_sum": 1.5, "items": 3, "preference": {"rewards/margins": [0.3, 3]}},
        {
            "rank": 1,
            "loss": 0.1,
            "loss_sum": 0.1,
            "items": 1,
            "preference": {"rewards/margins": [0.5, 1], "kl": [0, 0]},
        },
    ]
    assert step_loss(ranks) == pytest.approx(1.6 / 4)
    assert preference_figures(ranks) == {"rewards/margins": pytest.approx(0.2)}
    summary = eval_summary([{**r, "samples": r["items"]} for r in ranks])
    assert summary["eval_loss"] == pytest.approx(0.4) and summary["eval_rewards/margins"] == pytest.approx(
        0.2
    )
    assert "eval_perplexity" not in summary


# ---------------------------------------------------------------- the reference table
def test_the_reference_table_is_written_by_chunk_joined_with_its_sha256_and_refused_for_other_data(tmp_path):
    folder = tmp_path / "reference"
    assert store.chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]
    store.write_chunk(folder, 0, np.array([[1, 2], [3, 4]], dtype=np.float32))
    (folder / "part-000000002-000000004.npy").write_bytes(b"torn")  # a crash mid-write, no atomic rename
    assert store.done_chunks(folder, 5, 2) == {(0, 2)}
    store.write_chunk(folder, 2, np.array([[5, 6], [7, 8]], dtype=np.float32))
    store.write_chunk(folder, 4, np.array([[9, 10]], dtype=np.float32))
    table = store.finish(folder, 5, "d1", 2)
    assert store.load_table(table).tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    assert store.complete(folder, 5, "d1") == table
    assert not list(folder.glob("part-*")), "the parts are removed once the table is whole"
    with pytest.raises(store.ReferenceError, match="the data changed"):
        store.complete(folder, 5, "d2")
    (folder / store.TABLE).write_bytes((folder / store.TABLE).read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(store.ReferenceError, match="sha256"):
        store.load_table(table)


# ---------------------------------------------------------------- the config
def load(*overrides: str) -> Any:
    return load_config(ROOT / "conf" / "tiny-cpu.yaml", list(overrides))


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["training.objective=ppo"], "training.objective: got 'ppo'; expected lm"),
        (["training.objective=dpo"], "data.source: got 'generated'; training.objective dpo reads preference"),
        (
            ["training.objective=dpo", "data.source=sft", "preference.dpo_loss=bco"],
            "preference.dpo_loss: got 'bco'",
        ),
        (["training.objective=simpo", "data.source=sft", "preference.beta=0"], "preference.beta: got 0.0"),
        (
            [
                "training.objective=dpo",
                "data.source=sft",
                "preference.dpo_loss=hinge",
                "preference.label_smoothing=0.1",
            ],
            "only dpo's sigmoid loss and simpo use it, not dpo hinge",
        ),
        (
            ["training.objective=dpo", "data.source=sft", "preference.reference=adapters"],
            "no adapters to switch off",
        ),
        (
            ["training.objective=kto", "data.source=sft", "preference.kto_undesirable_weight=-1"],
            "kto_undesirable_weight",
        ),
        (
            ["training.objective=orpo", "data.source=sft", "training.loss=mod:fn"],
            "training.objective orpo is the loss",
        ),
    ],
)
def test_bad_objective_settings_are_named_with_what_would_be_valid(overrides, words):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    assert words in str(e.value)
