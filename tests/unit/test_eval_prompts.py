"""`eval.prompts`: its config checks, which part of a record is its prompt, how prompts are encoded, and
what the controller records of every rank's completions (events, run.json, the MLflow table, status)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.config import ConfigError, load_config
from elastictrain.core.config_changes import classify_changes
from elastictrain.core.prompts import (
    BYTES,
    keep_last,
    one_line,
    prompt_count,
    prompt_tokenizer,
    rank_zero_completions,
    split_record,
    table,
    table_rows,
)

VALIDATES = ("eval.split=0.05", "eval.steps=1")


def config(tmp_path: Path, *overrides: str):  # noqa: ANN201
    return load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides])


def problems(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        config(tmp_path, *overrides)
    return str(e.value)


def test_a_record_s_prompt_is_its_unlabelled_start_or_else_its_first_half():
    assert split_record([1, 2, 3, 4, 5, 6]) == ([1, 2, 3], [4, 5, 6])  # plain text: cut in half
    # An instruction record: no loss on the prompt; the answer is the reference.
    assert split_record([7, 8, 9, 10, 11], [-100, -100, -100, 10, 11]) == ([7, 8, 9], [10, 11])
    # Padded plain text: the padding goes, the labelled text is cut in half.
    assert split_record([5, 6, 7, 8, 0, 0], [5, 6, 7, 8, -100, -100], [1, 1, 1, 1, 0, 0]) == ([5, 6], [7, 8])
    # Every label ignored, or none: no prompt/answer boundary, so the half rule.
    assert split_record([1, 2, 3, 4], [-100] * 4) == ([1, 2], [3, 4])
    assert split_record([9]) == ([9], [])


def test_n_records_give_the_first_n_prompts_at_most_the_set_s_size():
    assert prompt_count(4, 100) == 4 and prompt_count(4, 3) == 3 and prompt_count(4, 0) == 0


def test_a_long_prompt_keeps_its_end_within_the_model_s_positions():
    assert keep_last(list(range(10)), None, 5) == list(range(10))
    assert keep_last(list(range(10)), 12, 4) == list(range(2, 10))
    assert keep_last(list(range(10)), 20, 4) == list(range(10))


def test_the_prompt_tokenizer_is_the_validation_data_s_own(tmp_path):
    assert prompt_tokenizer(config(tmp_path).data, None) == BYTES  # generated data: bytes
    data = config(tmp_path).data
    data.source, data.tokenizer = "tokens", None
    assert prompt_tokenizer(data, "/models/base") == "/models/base"  # the pretrained folder's
    data.tokenizer = "/tok"
    assert prompt_tokenizer(data, "/models/base") == "/tok"
    assert prompt_tokenizer(data, None) == "/tok"
    data.tokenizer = None
    assert prompt_tokenizer(data, None) is None


def test_prompts_as_strings_or_a_number_load(tmp_path):
    cfg = config(tmp_path, *VALIDATES, "eval.prompts=['The fox', 'A robot']", "eval.max_new_tokens=8")
    assert cfg.eval.prompts == ["The fox", "A robot"] and cfg.eval.max_new_tokens == 8
    assert config(tmp_path, *VALIDATES, "eval.prompts=3").eval.prompts == 3
    assert config(tmp_path).eval.prompts is None and config(tmp_path).eval.chat_template is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.prompts=0"], "eval.prompts: got 0; expected N >= 1 validation records"),
        (["eval.prompts=true"], "eval.prompts: got True; expected a list of prompt strings, or a number N"),
        (["eval.prompts=[]"], "eval.prompts: got []; expected a non-empty list of non-empty strings"),
        (["eval.prompts=[a, 3]"], "expected a non-empty list of non-empty strings (quote a prompt"),
        (["eval.prompts={a: b}"], "eval.prompts: got {'a': 'b'}; expected a list of prompt strings"),
        (["eval.max_new_tokens=0"], "eval.max_new_tokens: got 0; expected >= 1"),
        (
            ["eval.prompts=2", "eval.max_new_tokens=128"],
            "eval.max_new_tokens: got 128; expected < the model's positions "
            "(model.hf_config.max_position_embeddings: 128)",
        ),
    ],
)
def test_bad_prompt_settings_name_the_field_and_what_would_be_valid(tmp_path, overrides, message):
    assert message in problems(tmp_path, *VALIDATES, *overrides)


def test_prompts_need_a_validation_and_a_tokenizer(tmp_path):
    assert "eval.prompts: set, but the run does not validate" in problems(tmp_path, "eval.prompts=['x']")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "shard-00000.bin").write_bytes(b"\0" * 4096)
    tokens = ("data.source=tokens", f"data.path={shards}")
    message = problems(tmp_path, *VALIDATES, *tokens, "eval.prompts=['x']")
    assert (
        "eval.prompts: no tokenizer to encode prompts and decode completions; set data.tokenizer" in message
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    message = problems(tmp_path, *VALIDATES, *tokens, f"model.pretrained={model}", "eval.prompts=['x']")
    assert f"eval.prompts: model.pretrained '{model}' holds no tokenizer" in message
    assert "; or set data.tokenizer" in message


def test_a_resume_may_change_what_the_model_is_asked():
    changes = classify_changes(
        {"eval.prompts": None, "eval.max_new_tokens": 32, "eval.chat_template": True},
        {"eval.prompts": '["a"]', "eval.max_new_tokens": 8, "eval.chat_template": False},
    )
    assert set(changes.allowed) == {"eval.prompts", "eval.max_new_tokens", "eval.chat_template"}
    assert not changes.refused


def test_rank_zero_s_completions_are_logged_and_disagreement_is_noticed():
    said = [{"prompt": "a", "completion": "b", "reference": ""}]
    other = [{"prompt": "a", "completion": "c", "reference": ""}]
    assert rank_zero_completions([{"rank": 1, "completions": said}, {"rank": 0, "completions": said}]) == (
        said,
        True,
    )
    assert rank_zero_completions([{"rank": 1, "completions": other}, {"rank": 0, "completions": said}]) == (
        said,
        False,
    )
    assert rank_zero_completions([{"rank": 0}]) == ([], True)


def test_the_table_has_mlflow_log_table_s_layout():
    import pandas as pd

    rows = table_rows(4, [{"prompt": "a", "completion": "b", "reference": "c"}]) + table_rows(
        8, [{"prompt": "a", "completion": "d"}]
    )
    frame = pd.read_json(io.StringIO(json.dumps(table(rows))), orient="split")  # as mlflow.load_table
    assert frame.to_dict("records") == [
        {"step": 4, "prompt": "a", "completion": "b", "reference": "c"},
        {"step": 8, "prompt": "a", "completion": "d", "reference": ""},
    ]
    assert one_line("a\nb") == "a\\nb" and one_line("x" * 100, 11) == "xxxx...xxxx"


def test_bytes_and_records_become_prompts(tmp_path):
    from elastictrain.worker.generate import ByteCodec, _from_records

    codec = ByteCodec()
    assert codec.encode("héllo") == list("héllo".encode()) and codec.decode(codec.encode("héllo")) == "héllo"
    assert codec.decode([104, 105, 300]) == "hi"  # ids past the bytes are dropped
    records = [
        torch.tensor(list(b"The fox sees")),
        {"input_ids": torch.tensor(list(b"ab:cd")), "labels": torch.tensor([-100, -100, -100, 99, 100])},
    ]
    prompts = _from_records(records, 5, codec)
    assert [(p.text, p.reference) for p in prompts] == [("The fo", "x sees"), ("ab:", "cd")]
    with pytest.raises(ValueError, match="eval.prompts: got 1; a validation record is a str"):
        _from_records(["text"], 1, codec)


def tiny_tokenizer(folder: Path, chat_template: str | None) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = ["the fox sees a lamp", "user : assistant :"]
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


def test_string_prompts_go_through_the_chat_template_where_the_tokenizer_has_one(tmp_path):
    from elastictrain.data.hf_files import load_tokenizer
    from elastictrain.worker.generate import TokenizerCodec

    template = (
        "{% for m in messages %}user : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    tiny_tokenizer(tmp_path / "chat", template)
    tiny_tokenizer(tmp_path / "plain", None)
    chat = TokenizerCodec(load_tokenizer(str(tmp_path / "chat")), chat=True, special_tokens=False)
    assert chat.decode(chat.encode("the fox")) == "user : the fox assistant :"
    off = TokenizerCodec(load_tokenizer(str(tmp_path / "chat")), chat=False, special_tokens=False)
    assert off.decode(off.encode("the fox")) == "the fox"
    plain = TokenizerCodec(load_tokenizer(str(tmp_path / "plain")), chat=True, special_tokens=False)
    assert plain.decode(plain.encode("the fox")) == "the fox" and plain.eos_token_id == 2


class Recorded:
    """A tracker that keeps what it is given."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[str, bool]] = {}

    def log_event(self, record: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact_text(self, text: str, artifact_file: str, *, table: bool = False) -> None:
        self.texts[artifact_file] = (text, table)


def test_completions_are_recorded_once_per_validation_everywhere_and_survive_a_driver_restart(tmp_path):
    from typer.testing import CliRunner

    from elastictrain.cli import app
    from elastictrain.config import config_digest, to_yaml
    from elastictrain.control.evaluation import Evaluations
    from elastictrain.control.progress import Reporter
    from elastictrain.control.record import RunRecorder
    from elastictrain.rundir.run_dir import RunDir

    cfg = config(tmp_path, *VALIDATES, "eval.prompts=['The fox']")
    run_dir = RunDir.create(
        tmp_path / "run", name="p", config_yaml=to_yaml(cfg), config_digest=config_digest(cfg)
    )
    terminal = io.StringIO()

    def results(text: str, other: str | None = None) -> list[dict[str, Any]]:
        share = {"loss_sum": 3.0, "target_tokens": 3, "samples": 1}
        said = [{"prompt": "The fox", "completion": text, "reference": ""}]
        rank1 = [{**said[0], "completion": other or text}]
        return [{**share, "rank": 0, "completions": said}, {**share, "rank": 1, "completions": rank1}]

    tracker = Recorded()
    evals = Evaluations(cfg, RunRecorder(run_dir, tracker, Reporter(12, stream=terminal, live=False)))
    evals.record(4, results(" sees\na lamp"))
    evals.record(4, results("again"))  # repeated after a restart: recorded once
    tracker = Recorded()  # a new driver on the same run folder
    evals = Evaluations(cfg, RunRecorder(run_dir, tracker, Reporter(12, stream=terminal, live=False)))
    evals.record(8, results(" sees", other=" runs"))

    said = [e for e in run_dir.read_events() if e["event"] == "completions"]
    assert [(e["step"], e["ranks_agree"]) for e in said] == [(4, True), (8, False)]
    assert said[0]["completions"] == [{"prompt": "The fox", "completion": " sees\na lamp", "reference": ""}]
    assert "model at step 4: 'The fox' -> ' sees\\\\na lamp'" in terminal.getvalue()
    assert "the ranks generated different text" in terminal.getvalue()
    text, is_table = tracker.texts["eval_completions.json"]
    assert is_table and json.loads(text)["data"] == [
        [4, "The fox", " sees\na lamp", ""],
        [8, "The fox", " sees", ""],
    ]
    status = CliRunner().invoke(app, ["status", str(run_dir.path)])
    assert status.exit_code == 0, status.output
    assert 'model says (step 8, greedy):\n  "The fox" -> " sees"' in status.output


def test_a_model_without_generate_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    from elastictrain.driver.preflight import check_user_code
    from elastictrain.user_code import UserCodeError

    (tmp_path / "prompt_factories.py").write_text(
        "import torch\n"
        "def build_model(config):\n    return torch.nn.Linear(3, 1)\n"
        "def build_dataset(config):\n    return [torch.tensor([1, 2, 3])] * 20\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tiny_tokenizer(tmp_path / "tok", None)
    cfg = config(
        tmp_path,
        *VALIDATES,
        "model.factory=prompt_factories:build_model",
        "data.source=factory",
        "data.factory=prompt_factories:build_dataset",
        f"data.tokenizer={tmp_path / 'tok'}",
        "eval.prompts=['the fox']",
    )
    with pytest.raises(
        UserCodeError, match=r"eval.prompts: set, but the model of model.factory .* no generate\(\)"
    ):
        check_user_code(cfg)
