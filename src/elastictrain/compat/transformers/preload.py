"""Build a transformers model of a given class from its config as the auto classes do."""

from __future__ import annotations

from typing import Any

from elastictrain.compat.registry import has_parameters, patch
from elastictrain.compat.transformers.hf_init import TRANSFORMERS_TESTED


def _check_from_config() -> str | None:
    from transformers.modeling_utils import PreTrainedModel

    return has_parameters(PreTrainedModel._from_config, "config", where="PreTrainedModel._from_config")


@patch(
    "hf_model_from_config",
    package="transformers",
    tested=TRANSFORMERS_TESTED,
    kind="correctness",
    check=_check_from_config,
    gains=(
        "correctness: an exported model is rebuilt with the attention and dtype handling it was trained with"
    ),
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
