"""Issue 57: the tokenizer written beside an exported model or adapter loads, from that folder alone, as the
class the run tokenized with; and a LoRA run whose model.lora.export_dir is its run folder holds its
adapter and tokenizer at the folder's top, nothing else in it touched.

The case: transformers 5's AutoTokenizer picks the class from config.json's model_type when the folder
has one (qwen2: Qwen2Tokenizer, which splits numbers into digits), else from tokenizer_config.json's
tokenizer_class (TokenizersBackend, what PreTrainedTokenizerFast.save_pretrained writes: it tokenizes
as tokenizer.json says). A qwen2 folder saved so trains with Qwen2Tokenizer; the same tokenizer files
in an adapter folder (no config.json) loaded as TokenizersBackend, and a tokenizer whose BPE merged
digits then tokenized "123" otherwise, so `export` refused every LoRA run of such a folder.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from integration.pretrained_models import make_pretrained, make_tokenizer
from typer.testing import CliRunner
from unit.export_checkpoints import checkpoint_of, trained  # importable from tests/integration too

from elastictrain.cli import app
from elastictrain.tools.export_check import ExportCheckFailed, same_tokenizer
from elastictrain.tools.tokenizer_files import TOKENIZER_FILES, copy_tokenizer

# Numbers in the text the tokenizer is trained on: its BPE merges digits ("123", "2024"), as real ones do.
_DIGITS_TEXT = "in 2024 the 123 numbers of 365 days count 1024 steps. " * 3
CHECKED = "Hello, world: 123 export check."  # export_check.same_tokenizer's text


def digit_merging_tokenizer():  # noqa: ANN201 - transformers.PreTrainedTokenizerFast
    """pretrained_models' qwen2 tokenizer (its special tokens, ids and chat template), trained on text
    with numbers: a byte-level BPE whose merges join digits, saved as TokenizersBackend."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    like = make_tokenizer("qwen2")
    specials = [like.pad_token, like.eos_token, "<|im_start|>"]  # pretrained_models' order: the same ids
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["the quick brown fox answers the user. " + _DIGITS_TEXT] * 20, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=like.pad_token, eos_token=like.eos_token
    )
    wrapped.chat_template = like.chat_template
    assert [wrapped.pad_token_id, wrapped.eos_token_id] == [like.pad_token_id, like.eos_token_id]
    return wrapped


def qwen2_folder_with_digit_merges(folder: Path) -> Path:
    """pretrained_models' tiny qwen2 folder (config.json model_type qwen2) with digit_merging_tokenizer
    saved into it: tokenizer_config.json names TokenizersBackend, the folder loads as Qwen2Tokenizer."""
    make_pretrained(folder, "qwen2")
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    digit_merging_tokenizer().save_pretrained(folder)
    return folder


def tokenizer_files_of(folder: Path, into: Path) -> Path:
    into.mkdir(parents=True)
    for path in folder.iterdir():
        if path.name in TOKENIZER_FILES:
            shutil.copy2(path, into / path.name)
    return into


def loaded(folder: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return qwen2_folder_with_digit_merges(tmp_path_factory.mktemp("src") / "qwen")


def test_a_qwen2_folder_saved_as_tokenizers_backend_tokenizes_digits_otherwise_without_its_config(
    qwen, tmp_path
):
    """The reproduction: the same tokenizer files, with and without the model's config.json beside them."""
    assert json.loads((qwen / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert json.loads((qwen / "config.json").read_text())["model_type"] == "qwen2"
    alone = tokenizer_files_of(qwen, tmp_path / "alone")
    with_config, without = loaded(qwen), loaded(alone)
    assert type(with_config).__name__ == "Qwen2Tokenizer" and type(without).__name__ == "TokenizersBackend"
    assert with_config.tokenize("2024") == ["2", "0", "2", "4"]  # Qwen2's pre-tokenizer: one digit each
    assert without.tokenize("2024") != with_config.tokenize("2024")  # tokenizer.json's merges join them
    assert without(CHECKED)["input_ids"] != with_config(CHECKED)["input_ids"]
    with pytest.raises(ExportCheckFailed, match="does not tokenize as"):
        same_tokenizer(str(qwen), alone)  # what `export` said of every LoRA run of such a folder


def test_the_copied_tokenizer_records_the_class_the_run_tokenized_with_and_loads_as_it_alone(qwen, tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    copied = copy_tokenizer(qwen, out)
    assert copied.recorded and copied.ran_with == copied.loads_as == "Qwen2Tokenizer"
    assert type(loaded(out)).__name__ == "Qwen2Tokenizer"
    before = json.loads((qwen / "tokenizer_config.json").read_text())
    after = json.loads((out / "tokenizer_config.json").read_text())
    assert after == before | {"tokenizer_class": "Qwen2Tokenizer"}, "only the class is changed"
    for name in set(copied.files) - {"tokenizer_config.json"}:
        assert (out / name).read_bytes() == (qwen / name).read_bytes(), name
    same_tokenizer(str(qwen), out)
    assert sorted(p.name for p in out.iterdir()) == copied.files, "no temporary file is left"


def test_a_copy_that_already_loads_as_the_source_is_left_as_the_source_wrote_it(qwen, tmp_path):
    tokenizer_only = tokenizer_files_of(qwen, tmp_path / "tokenizer")  # loads as TokenizersBackend
    beside_a_qwen2_config = tmp_path / "model"  # a full export: config.json is written first
    beside_a_qwen2_config.mkdir()
    shutil.copy2(qwen / "config.json", beside_a_qwen2_config / "config.json")
    for source, out in ((tokenizer_only, tmp_path / "copy"), (qwen, beside_a_qwen2_config)):
        out.mkdir(exist_ok=True)
        copied = copy_tokenizer(source, out)
        assert not copied.recorded and copied.loads_as == copied.ran_with
        for name in copied.files:
            assert (out / name).read_bytes() == (source / name).read_bytes(), (source, name)
        same_tokenizer(str(source), out)


def invoke(args: list[str], code: int = 0) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return " ".join(result.output.split())


def test_full_and_lora_runs_of_such_a_folder_export_and_pass_the_tokenizer_check(qwen, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    full = checkpoint_of(
        trained(AutoModelForCausalLM.from_pretrained(qwen)), tmp_path / "full", pretrained=qwen
    )
    lora = checkpoint_of(
        trained(
            get_peft_model(AutoModelForCausalLM.from_pretrained(qwen), LoraConfig(target_modules=["v_proj"]))
        ),
        tmp_path / "lora",
        pretrained=qwen,
    )
    for checkpoint, kind in ((full, "model"), (lora, "adapter")):
        out = tmp_path / f"{kind}-export"
        assert f"({kind}, float32)" in invoke(["export", str(checkpoint), "--out", str(out)])
        assert type(loaded(out)).__name__ == "Qwen2Tokenizer"
        assert loaded(out)(CHECKED)["input_ids"] == loaded(qwen)(CHECKED)["input_ids"]
    adapter_config = json.loads((tmp_path / "adapter-export" / "tokenizer_config.json").read_text())
    assert adapter_config["tokenizer_class"] == "Qwen2Tokenizer"


def test_a_full_export_whose_config_overrides_the_runs_tokenizer_class_is_refused_saying_why(qwen, tmp_path):
    """A run of a qwen2 model tokenized with a tokenizer-only folder (TokenizersBackend): its export's
    config.json makes transformers load Qwen2Tokenizer whatever tokenizer_config.json names."""
    from transformers import AutoModelForCausalLM

    from elastictrain.checkpoint.store import MANIFEST
    from elastictrain.tools.export import export_checkpoint

    checkpoint = checkpoint_of(AutoModelForCausalLM.from_pretrained(qwen), tmp_path / "ck", pretrained=qwen)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["model"]["tokenizer"] = str(tokenizer_files_of(qwen, tmp_path / "data-tokenizer"))
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        ExportCheckFailed, match="it loads as Qwen2Tokenizer, the run tokenized with TokenizersBackend"
    ):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def lora_run_config(run: Path, base: Path, export_dir: str):  # noqa: ANN201 - Config
    from elastictrain.config import load_config

    return load_config(
        None,
        [
            f"run.dir={run}",
            f"model.pretrained={base}",
            "model.lora.enabled=true",
            "model.lora.target_modules=[q_proj,v_proj]",
            f"model.lora.export_dir={export_dir}",
        ],
    )


def files_and_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_lora_run_with_its_run_folder_as_export_dir_holds_adapter_and_tokenizer_at_its_top(qwen, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from elastictrain.control.progress import Reporter
    from elastictrain.driver.launch import export_at_finish, prepare_run_dir
    from elastictrain.model.lora import apply_lora

    config = lora_run_config(tmp_path / "run", qwen, "${run.dir}")
    assert Path(config.model.lora.export_dir).resolve() == Path(config.run.dir).resolve()
    run_dir, _ = prepare_run_dir(config, fresh=False)
    wrapped = trained(apply_lora(AutoModelForCausalLM.from_pretrained(qwen), config.model.lora))
    checkpoint_of(wrapped, run_dir.checkpoints_dir, pretrained=qwen)
    run_dir.append_event("run_started")  # what a run's folder holds by its end, an MLflow store too
    (run_dir.path / "mlflow").mkdir()
    (run_dir.path / "mlflow" / "store.db").write_bytes(b"the run's own")
    before = files_and_bytes(run_dir.path)
    reporter = Reporter(1, stream=io.StringIO(), live=False)

    export_at_finish(config, run_dir, reporter)
    export_at_finish(config, run_dir, reporter)  # a second finish (a resumed run's) replaces them

    top = run_dir.path
    after = files_and_bytes(top)
    assert {k: v for k, v in after.items() if k in before and k != "events.jsonl"} == {
        k: v for k, v in before.items() if k != "events.jsonl"
    }, "nothing of the run's is changed"
    assert after["events.jsonl"].startswith(before["events.jsonl"])
    new = sorted(set(after) - set(before))
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(new)
    assert not [n for n in new if n.startswith(".") or "/" in n], f"a temporary left behind: {new}"
    event = [e for e in run_dir.read_events() if e["event"] == "adapter_exported"][-1]
    assert event["path"] == str(top) and sorted(event["files"]) == new
    assert "with its tokenizer (Qwen2Tokenizer)" in reporter.stream.getvalue()

    assert type(loaded(top)).__name__ == "Qwen2Tokenizer"
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    from_top = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen), top).eval()
    with torch.no_grad():
        diff = (from_top(input_ids=ids).logits - wrapped.eval()(input_ids=ids).logits).abs().max().item()
    assert diff == 0.0, diff

    # `elastictrain export RUN_DIR` still finds the run's checkpoint, not the adapter at its top.
    output = invoke(["export", str(top), "--out", str(tmp_path / "exported")])
    assert "(adapter, float32)" in output and "step-000004" in output
    assert files_and_bytes(top) == after


def test_the_default_export_dir_still_gets_the_adapter_and_now_the_tokenizer(qwen, tmp_path):
    from transformers import AutoModelForCausalLM

    from elastictrain.control.progress import Reporter
    from elastictrain.driver.launch import export_at_finish, prepare_run_dir
    from elastictrain.model.lora import apply_lora

    config = lora_run_config(tmp_path / "run", qwen, "${run.dir}/adapter")
    run_dir, _ = prepare_run_dir(config, fresh=False)
    wrapped = trained(apply_lora(AutoModelForCausalLM.from_pretrained(qwen), config.model.lora))
    checkpoint_of(wrapped, run_dir.checkpoints_dir, pretrained=qwen)
    export_at_finish(config, run_dir, Reporter(1, stream=io.StringIO(), live=False))
    adapter = run_dir.path / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert not (run_dir.path / "adapter_config.json").exists()
    assert type(loaded(adapter)).__name__ == "Qwen2Tokenizer"
    same_tokenizer(str(qwen), adapter)
