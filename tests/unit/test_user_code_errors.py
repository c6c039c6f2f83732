"""User code named in the config (or given to fit): resolved from import paths, and refused early, naming
the field, when a path does not import, a factory returns the wrong kind of object, or a dataset has no
length. Nothing here starts Ray or DeepSpeed: these checks run on the driver before any worker exists.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.config import ConfigError, load_config
from elastictrain.data.sources import collate_items, dataset_from_config
from elastictrain.driver.preflight import check_user_code
from elastictrain.model.build import causal_lm_loss, loss_function
from elastictrain.user_code import (
    UserCodeError,
    attach,
    call_factory,
    imports_user_modules,
    label_for,
    share_module_roots,
    user_model,
)

FACTORIES = """
import torch
from torch import nn

class Pairs:
    def __init__(self, n=10):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(float(i))}

class Empty(Pairs):
    def __len__(self):
        return 0

class Stream:  # iterable only: no length, no item access
    def __iter__(self):
        yield from range(3)

class Sized:  # a length but no item access
    def __len__(self):
        return 3

class Words:
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return "word"

def build_model(config):
    return nn.Linear(3, int(config.model.args.get("out", 1)))

def build_model_without_args():
    return nn.Linear(3, 2)

def returns_dict(config):
    return {"not": "a module"}

def build_dataset(config):
    return Pairs(int(config.data.args.get("size", 10)))

def stream(config):
    return Stream()

def sized(config):
    return Sized()

def empty(config):
    return Empty()

def words(config):
    return Words()

def loss(model, batch):
    return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()

def collate(items):
    return {"x": torch.stack([i["x"] for i in items]), "y": torch.stack([i["y"] for i in items])}

NOT_CALLABLE = 3
"""


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user package `userpkg_<n>` importable from this process, as a user's own code would be."""
    name = f"userpkg_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "code.py").write_text(textwrap.dedent(FACTORIES))
    (tmp_path / name / "broken.py").write_text("raise RuntimeError('database not reachable')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}.code"


def config(tmp_path: Path, *overrides: str):  # noqa: ANN201
    return load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides])


def factory_config(tmp_path: Path, pkg: str, *overrides: str):  # noqa: ANN201
    return config(
        tmp_path,
        f"model.factory={pkg}:build_model",
        "data.source=factory",
        f"data.factory={pkg}:build_dataset",
        f"training.loss={pkg}:loss",
        *overrides,
    )


def error(cfg) -> str:  # noqa: ANN001
    with pytest.raises(UserCodeError) as e:
        check_user_code(cfg)
    return str(e.value)


# -- import paths that work ----------------------------------------------------------------------------
def test_import_path_factories_build_the_model_dataset_loss_and_batches(tmp_path, pkg):
    cfg = factory_config(tmp_path, pkg, "model.args.out=2", "data.args.size=7")
    check_user_code(cfg)
    model = user_model(cfg)
    assert isinstance(model, torch.nn.Linear) and model.out_features == 2  # config.model.args reached it
    dataset = dataset_from_config(cfg)
    assert len(dataset) == 7
    batch = collate_items([dataset[i] for i in (1, 4)])
    assert batch["x"].shape == (2, 3) and batch["y"].tolist() == [1.0, 4.0]  # dicts of stacked tensors
    loss = loss_function(cfg)
    assert loss.__name__ == "loss" and loss(torch.nn.Linear(3, 1), batch).ndim == 0


def test_collate_and_factories_without_arguments(tmp_path, pkg):
    cfg = factory_config(
        tmp_path, pkg, f"model.factory={pkg}:build_model_without_args", f"data.collate={pkg}:collate"
    )
    check_user_code(cfg)
    assert user_model(cfg).out_features == 2
    assert loss_function(config(tmp_path)) is causal_lm_loss  # the default when training.loss is not set
    assert call_factory("f", lambda: 5, cfg) == 5 and call_factory("f", lambda c: c, cfg) is cfg


def test_the_model_factory_is_checked_on_the_meta_device(tmp_path, pkg):
    # The driver's check allocates no weights: a model of any size is checked for free.
    cfg = factory_config(tmp_path, pkg)
    with torch.device("meta"):
        assert user_model(cfg).weight.is_meta


# -- errors that name the field ------------------------------------------------------------------------
def test_a_path_that_does_not_import(tmp_path):
    cfg = config(tmp_path, "model.factory=mypkg.nope:build")
    assert error(cfg) == "model.factory: 'mypkg.nope:build' does not import: No module named 'mypkg'"


def test_a_module_that_raises_on_import_or_lacks_the_attribute(tmp_path, pkg):
    broken = pkg.replace(".code", ".broken")
    assert error(config(tmp_path, f"model.factory={broken}:build")) == (
        f"model.factory: '{broken}:build' does not import: database not reachable"
    )
    assert error(config(tmp_path, f"training.loss={pkg}:nope")) == (
        f"training.loss: '{pkg}:nope' does not resolve: module '{pkg}' has no attribute 'nope'"
    )


def test_a_factory_that_returns_the_wrong_kind_of_object(tmp_path, pkg):
    cfg = factory_config(tmp_path, pkg, f"model.factory={pkg}:returns_dict")
    assert error(cfg) == (
        f"model.factory: '{pkg}:returns_dict' returned builtins.dict object; expected a torch.nn.Module"
    )


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("stream", "has no __len__ and no __getitem__; expected a map-style dataset"),
        ("sized", "has no __getitem__; expected a map-style dataset"),
        ("empty", "gave a dataset of length 0; expected at least 1 sample"),
    ],
)
def test_a_dataset_without_a_length_or_items_or_samples(tmp_path, pkg, factory, expected):
    message = error(factory_config(tmp_path, pkg, f"data.factory={pkg}:{factory}"))
    assert message.startswith(f"data.factory: '{pkg}:{factory}' gave") and expected in message
    if factory == "stream":
        assert "an iterable-only dataset cannot be used" in message


def test_a_loss_that_is_not_callable_and_items_that_do_not_collate(tmp_path, pkg):
    assert error(factory_config(tmp_path, pkg, f"training.loss={pkg}:NOT_CALLABLE")) == (
        f"training.loss: '{pkg}:NOT_CALLABLE' is builtins.int object; expected a callable"
    )
    message = error(factory_config(tmp_path, pkg, f"data.factory={pkg}:words"))
    assert message.startswith(f"data.factory: collating item 0 of '{pkg}:words' with the default collate")
    assert "cannot collate items of type str" in message and "give data.collate" in message


def test_activation_checkpointing_needs_a_model_that_supports_it(tmp_path, pkg):
    message = error(factory_config(tmp_path, pkg, "deepspeed.activation_checkpointing=true"))
    assert message.startswith("deepspeed.activation_checkpointing: true, but the model of model.factory")


def test_lora_targets_must_name_modules_of_the_model(tmp_path):
    message = error(config(tmp_path, "model.lora.enabled=true", "model.lora.target_modules=[qkv]"))
    assert message.startswith("model.lora.target_modules: ['qkv'] match no module of the model")
    assert "q_proj" in message  # the names it does have


def test_local_data_files_and_tokenizer_are_checked(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "a b c"}\n')
    (tmp_path / "tok").mkdir()
    hf = ["data.source=hf", f"data.path={tmp_path / 'd.jsonl'}", f"data.tokenizer={tmp_path / 'tok'}"]
    assert error(config(tmp_path, *hf)).startswith(f"data.tokenizer: '{tmp_path / 'tok'}' does not load")

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>"))
    ).save_pretrained(tmp_path / "tok")
    assert error(config(tmp_path, *hf)) == (
        f"data.text_field: got 'text'; the columns of {tmp_path / 'd.jsonl'} are body"
    )
    check_user_code(config(tmp_path, *hf, "data.text_field=body"))


def test_an_object_given_to_fit_is_not_there_when_the_config_is_read_back(tmp_path):
    # e.g. `elastictrain resume` of a run that fit() started with a function defined in a script
    message = error(config(tmp_path, "model.factory=<__main__.build_model>"))
    assert message.startswith("model.factory: '<__main__.build_model>' was a Python object given to")
    assert "call elastictrain.fit(...) with it again" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.factory=not a path"],
            "model.factory: got 'not a path'; expected an import path 'module:attr'",
        ),
        (["data.collate=mod"], "data.collate: got 'mod'; expected an import path"),
        (
            ["data.factory=a.b:c"],
            "data.factory: got 'a.b:c' while data.source is 'generated'; set data.source",
        ),
        (["data.source=factory"], "data.factory: missing; expected an import path 'module:attr'"),
        (["model.factory=a:b", "model.pretrained=/x"], "model.pretrained: got '/x' and model.factory 'a:b'"),
        (["model.pretrained=/nonexistent"], "model.pretrained: got '/nonexistent'; expected a local folder"),
        (
            ["data.source=hf", "data.path=/nonexistent/*.jsonl"],
            "data.path: got '/nonexistent/*.jsonl'; no file",
        ),
        (["data.source=hf"], "data.tokenizer: missing; expected a local tokenizer folder"),
        (["data.format=xml"], "data.format: got 'xml'; expected one of json, csv, parquet, text"),
        (["model.lora.enabled=true", "model.lora.r=0"], "model.lora.r: got 0; expected a number >= 1"),
        (["model.lora.target_modules=q_proj"], "model.lora.target_modules: got 'q_proj'; expected a list"),
    ],
)
def test_config_fields_for_user_code_are_checked_when_loaded(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, *overrides)
    assert expected in str(e.value)


# -- the Python API's bookkeeping ----------------------------------------------------------------------
def test_objects_given_to_fit_are_recorded_by_import_path_when_they_have_one(tmp_path, pkg):
    import importlib

    module = importlib.import_module(pkg)
    assert label_for(module.build_model) == f"{pkg}:build_model"
    assert label_for(module.Pairs) == f"{pkg}:Pairs"
    assert label_for(module.Pairs(3)) == f"<{pkg}.Pairs object>"
    assert label_for(lambda m, b: 0).endswith(".<lambda>>")

    def local_loss(model, batch):  # noqa: ANN001, ANN202
        return 0

    assert label_for(local_loss).startswith("<") and "<locals>.local_loss" in label_for(local_loss)


def test_objects_travel_with_the_config_and_win_over_its_label(tmp_path, pkg):
    import copy
    import pickle

    cfg = config(tmp_path, "model.factory=<__main__.net>", "data.source=factory", "data.factory=<x.y object>")
    attach(cfg, {"model.factory": torch.nn.Linear(3, 4), "data.factory": [torch.zeros(2)] * 5})
    check_user_code(cfg)
    restored = pickle.loads(pickle.dumps(cfg))  # as Ray ships it to a worker
    built = user_model(restored)
    assert isinstance(built, torch.nn.Linear) and built.out_features == 4
    assert user_model(restored) is not built  # each attempt gets a fresh copy of a module given by value
    assert len(dataset_from_config(copy.deepcopy(restored))) == 5
    with pytest.raises(ValueError, match="user code fields"):
        attach(cfg, {"model.nope": 1})


def test_workers_find_user_modules_through_pythonpath(tmp_path, pkg, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/already/there")
    cfg = factory_config(tmp_path, pkg)
    check_user_code(cfg)  # imports the package, as the driver does
    assert share_module_roots(cfg) == [str(tmp_path.resolve())]
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/already/there", str(tmp_path.resolve())])
    assert share_module_roots(cfg) == []  # idempotent


def test_only_runs_without_user_modules_may_take_warm_workers(tmp_path, pkg):
    import importlib

    assert not imports_user_modules(config(tmp_path))  # a transformers model from the config
    assert imports_user_modules(factory_config(tmp_path, pkg))  # import paths: workers import them

    def build() -> torch.nn.Module:
        return torch.nn.Linear(2, 2)

    build.__module__ = "__main__"  # as a function defined in the user's script is
    by_value = config(tmp_path, "model.factory=<__main__.build>")
    attach(by_value, {"model.factory": build})
    assert not imports_user_modules(by_value)  # travels whole with the config
    by_reference = config(tmp_path, f"model.factory={pkg}:build_model")
    attach(by_reference, {"model.factory": importlib.import_module(pkg).build_model})
    assert imports_user_modules(by_reference)  # pickled by reference: the worker imports its module


# -- the same errors from the command line and from fit(), before anything exists ----------------------
def test_cli_and_fit_refuse_bad_user_code_before_any_run_folder_exists(tmp_path, pkg):
    result = CliRunner().invoke(
        app, ["train", f"run.dir={tmp_path / 'run'}", "model.factory=mypkg.nope:build"]
    )
    assert result.exit_code == 2
    assert "model.factory: 'mypkg.nope:build' does not import: No module named 'mypkg'" in result.output
    assert not (tmp_path / "run").exists()

    from elastictrain import fit

    with pytest.raises(UserCodeError, match=r"^data.factory: '<.*Sized object>' gave .* has no __getitem__"):
        import importlib

        fit(None, [f"run.dir={tmp_path / 'run'}"], dataset=importlib.import_module(pkg).Sized(), local=True)
    assert not (tmp_path / "run").exists()
