"""transformers' own weight initialization for models built under DeepSpeed's zero.Init.

Why it is needed: a transformers model initialises its weights in `post_init()`, at the end of its
`__init__`, by calling `_init_weights(module)` on every submodule (children first). Under zero.Init
each submodule's parameters are partitioned as soon as that submodule's `__init__` returns, so by the
time `post_init()` runs they are empty placeholders: `normal_(module.weight, std=0.02)` writes into an
empty tensor and the weights keep torch's default init (embeddings N(0, 1), linear layers
kaiming-uniform), and GPT-2 style scaled output projections are lost. transformers only re-runs its
init itself when it was told about ZeRO-3 (`HfDeepSpeedConfig`) and created the zero.Init context
itself; a model built inside a zero.Init of ours, or by a user's factory, gets nothing.

What this does: while active, each module's `_initialize_weights` call (the per-module step of
transformers' `initialize_weights`) runs with that module's partitioned parameters, and its direct
children's, gathered; every rank computes it from the same seed, rank 0's values are broadcast and
the parameters partitioned again. The calls happen at the same points and in the same order as
without DeepSpeed, and the gathered tensors have their full shapes, so the random stream is consumed
exactly as in `AutoModelForCausalLM.from_config`: for a seed, every parameter is bit-for-bit what
transformers gives outside DeepSpeed, at any world size. Only one module's parameters are gathered at
a time, never the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from elastictrain.compat.per_thread import replaced_in_this_thread
from elastictrain.compat.registry import first_problem, has_attributes, has_parameters, patch

# pyproject's range: `make test-compat TRANSFORMERS=X` passed on its ends (5.13.0, 5.25.0) and the
# whole suite runs 5.24. Before 5.13 `_initialize_weights` takes no `is_custom_code` (4.x, 5.0-5.12):
# the exact init under ZeRO-3 refuses there.
TRANSFORMERS_TESTED = ">=5.13"


def _check_initialize_weights() -> str | None:
    from transformers.modeling_utils import PreTrainedModel

    return has_parameters(PreTrainedModel._initialize_weights, "self", "module", "is_custom_code")


def _check_skip() -> str | None:
    from transformers import initialization

    return first_problem(
        _check_initialize_weights(),
        has_attributes(initialization, "TORCH_MODULES_TO_PATCH", "TORCH_INIT_FUNCTIONS"),
    )


def _init_as_usual(*args: Any, **kwargs: Any) -> Any:
    from contextlib import nullcontext

    return nullcontext()


def _params_init_may_touch(module: Any, pretrained_model_class: type) -> list[Any]:
    """The parameters `_init_weights(module)` may write: the module's and its children's.

    Children's, because several architectures initialise a child's weight from the parent (GPT-2's
    `c_proj.weight` scaled by depth is set from its attention and MLP blocks). A child that is a
    model of its own (a sub-model) initialises itself.
    """
    found = {id(p): p for p in module.parameters(recurse=False)}
    for child in module.children():
        if not isinstance(child, pretrained_model_class):
            found.update({id(p): p for p in child.parameters(recurse=False)})
    return list(found.values())


def _initialize_weights_replaced(replacement: Callable[[Any], Any]) -> AbstractContextManager[None]:
    """transformers' per-module init step (`PreTrainedModel._initialize_weights`) replaced by
    `replacement(what this thread called until now)`, for this thread only, while the block runs."""
    from transformers.modeling_utils import PreTrainedModel

    return replaced_in_this_thread(PreTrainedModel, "_initialize_weights", replacement)


@patch(
    "hf_init_exact_under_zero3",
    package="transformers",
    tested=TRANSFORMERS_TESTED,
    kind="correctness",
    check=_check_initialize_weights,
    gains=(
        "correctness: a config-built model under ZeRO-3 gets transformers' init: the same weights and losses"
        " as outside DeepSpeed"
    ),
)
@contextmanager
def exact_hf_init_under_zero3() -> Iterator[None]:
    """Make transformers models built inside this block initialise as they would outside DeepSpeed.

    What: `PreTrainedModel._initialize_weights` (transformers' per-module init step) runs with the
    module's partitioned parameters, and its direct children's, gathered (rank 0's values kept).
    Why: without it a model built inside our zero.Init keeps torch's default init, not transformers'
    (the module's docstring): the weights, and so the losses, differ from the same model outside
    DeepSpeed.
    Retired by: transformers running its weight init gathered whenever the model is built under a
    zero.Init it did not create (it does so only for one made through `HfDeepSpeedConfig`); no upstream
    issue found.
    """
    import deepspeed
    from transformers.modeling_utils import PreTrainedModel

    def gathered(original: Any) -> Any:
        def initialize_gathered(self: Any, module: Any, is_custom_code: bool = False) -> None:
            if getattr(module, "_is_hf_initialized", False):
                return  # already done (a sub-model initialised it): no gather
            # Parameters of a module still inside its own __init__ are not partitioned: nothing to gather.
            params = [p for p in _params_init_may_touch(module, PreTrainedModel) if hasattr(p, "ds_id")]
            if not params:
                original(self, module, is_custom_code)
                return
            # Every rank runs the init (same seed, same values) so their random streams stay equal;
            # modifier_rank=0 makes rank 0's result the one kept.
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                original(self, module, is_custom_code)

        return initialize_gathered

    with _initialize_weights_replaced(gathered):
        yield


@patch(
    "hf_init_skipped_for_restore",
    package="transformers",
    tested=TRANSFORMERS_TESTED,
    kind="performance",
    check=_check_skip,
    otherwise=_init_as_usual,
    gains=(
        "recovery time: a restoring build computes no init the load overwrites: building the model under "
        "zero.Init 1.95-2.04 -> 0.36-0.37 s at 134M on one rank (more ranks add its gathers and broadcasts)"
    ),
)
@contextmanager
def skip_parameter_init() -> Iterator[None]:
    """Build a transformers model without computing the parameter values a checkpoint will overwrite.

    What: for the calling thread only (compat/per_thread.py), the torch init functions transformers
    lists (`initialization.TORCH_INIT_FUNCTIONS` in `TORCH_MODULES_TO_PATCH`) become no-ops, and
    `_initialize_weights` marks each parameter `_is_hf_initialized` first, so only buffers are computed.
    Retired by: a transformers switch to build a model for loading (its `from_pretrained` does this
    internally, not for a model built from a config); no upstream issue found.

    Why: for an attempt that loads its state (a restart, a resize, a resume), the random init is work
    thrown away, and under ZeRO-3 it is the costly kind (each module gathered, initialised on every
    rank, rank 0's values broadcast; at 1B that is 4 GB gathered and broadcast). Torch's own
    constructor-time init (`reset_parameters`) is skipped, and each parameter is marked as
    transformers marks loaded ones (`_is_hf_initialized`), so `_init_weights` leaves it alone but still
    computes the buffers (rotary `inv_freq`), which no checkpoint holds. Only for models whose every
    parameter the checkpoint restores: not for LoRA's frozen base, not for a user's own model code.
    """
    import sys

    from transformers import initialization
    from transformers.modeling_utils import PreTrainedModel

    def buffers_only(original: Any) -> Any:
        def initialize_buffers_only(self: Any, module: Any, is_custom_code: bool = False) -> None:
            for param in _params_init_may_touch(module, PreTrainedModel):
                param._is_hf_initialized = True
            original(self, module, is_custom_code)

        return initialize_buffers_only

    def skipped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    with ExitStack() as replaced:
        for module_name in initialization.TORCH_MODULES_TO_PATCH:
            module = sys.modules.get(module_name)
            for name in initialization.TORCH_INIT_FUNCTIONS:
                if module is not None and hasattr(module, name):
                    replaced.enter_context(replaced_in_this_thread(module, name, lambda _: skipped))
        replaced.enter_context(_initialize_weights_replaced(buffers_only))
        yield
