"""Import a transformers model's code before DeepSpeed's zero.Init patches tensor construction."""

from __future__ import annotations

from typing import Any

from elastictrain.compat.registry import has_attributes, has_parameters, patch


def import_modeling_code() -> None:
    """Import `transformers.modeling_utils` the cheap way, whichever caller comes first.

    Two patches only act when they come before it (transformers' import structure from elastictrain's
    cache, SciPy's optimizer and boto3 deferred): a check of a patch that imported it first (the worker's
    `check_all` did) left every worker paying both costs, 0.7 CPU s of its 4 s warm-up on 2 cores.
    Everything here that imports transformers' modeling code calls this first.
    """
    from elastictrain.compat.transformers.deferred_imports import import_losses_deferring_unused
    from elastictrain.compat.transformers.import_structure import cache_import_structure

    cache_import_structure()  # before transformers.models is first imported
    import_losses_deferring_unused()  # before transformers.modeling_utils, which imports the losses
    import transformers.modeling_utils  # noqa: F401


def _check() -> str | None:
    import_modeling_code()
    from transformers import AutoModelForCausalLM

    return has_attributes(AutoModelForCausalLM, "_model_mapping")


def _left_lazy(hf_config: Any) -> None:
    return None  # the model class is imported at the build instead, inside zero.Init


@patch(
    "hf_model_class_preloaded",
    package="transformers",
    tested=">=4.45",
    kind="performance",
    check=_check,
    otherwise=_left_lazy,
)
def resolve_model_class(hf_config: Any) -> None:
    """Import the causal LM class of `hf_config` now (transformers imports it lazily at the build).

    What: reads `AutoModelForCausalLM._model_mapping[type(hf_config)]`, which imports the model's module.
    Why: paid while a worker warms up rather than on a replacement's critical path, and outside
    zero.Init, which patches tensor construction (lazy imports inside it have failed).
    Retired by: a public transformers call that resolves an auto class's model class without building
    it; no upstream issue found.
    """
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(hf_config)]


def _check_from_config() -> str | None:
    import_modeling_code()
    from transformers.modeling_utils import PreTrainedModel

    return has_parameters(PreTrainedModel._from_config, "config", where="PreTrainedModel._from_config")


@patch(
    "hf_model_from_config",
    package="transformers",
    tested=">=4.45",
    kind="correctness",
    check=_check_from_config,
)
def model_from_config(model_class: Any, config: Any) -> Any:
    """A model of transformers class `model_class` built from `config` as `AutoModel.from_config` builds
    one (`model_class._from_config`, the classmethod the auto classes call).

    What: calls the private `_from_config` classmethod; nothing is replaced.
    Why: an export rebuilds the recorded architecture (not always the causal LM auto class) with the
    attention implementation and dtype handling `from_config` applies; `model_class(config)` skips them.
    Retired by: a public `from_config` on every model class (transformers has one only on the auto
    classes); no upstream issue found.
    """
    return model_class._from_config(config)
