"""LoRA adapters (peft) on top of a ZeRO-3 model (the export of the adapter is tools/adapter.py).

Only the adapters train (A and B, DoRA's magnitude vectors, the copies of `modules_to_save`), so only
they enter the optimizer and the checkpoints (zero_state.py saves what the optimizer holds), and a
resume at any world size reshards their state like any other. The frozen base needs no saving: it is
rebuilt the same way at every (re)start, from the pretrained folder, or from `training.seed` for a
config-built or factory model (every rank and every world size builds the same weights from the same
seed); a `modules_to_save` copy starts from it and then comes from the checkpoint.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from elastictrain.compat.peft.zero3 import base_weights_gathered_for_peft
from elastictrain.config.lora_check import ALL_LINEAR, is_all_linear


def peft_target_modules(target_modules: Any) -> str | list[str]:
    """`model.lora.target_modules` as peft takes it: a list of names, or its own `all-linear`."""
    return ALL_LINEAR if is_all_linear(target_modules) else list(target_modules)


def peft_config(lora: Any, model: torch.nn.Module) -> Any:
    from peft import LoraConfig

    is_transformers = hasattr(model, "prepare_inputs_for_generation")
    return LoraConfig(
        r=int(lora.r),
        lora_alpha=float(lora.alpha),
        lora_dropout=float(lora.dropout),
        target_modules=peft_target_modules(lora.target_modules),
        use_dora=bool(lora.use_dora),
        use_rslora=bool(lora.use_rslora),
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM" if is_transformers else None,
    )


def _layer_names(model: torch.nn.Module) -> str:
    # Layers (modules without children) are what LoRA wraps: name those.
    leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and not any(m.children())}
    return ", ".join(sorted(n for n in leaves if not n.isdigit())[:20])


def _check_targets(model: torch.nn.Module, lora: Any) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if is_all_linear(lora.target_modules):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        if not linear:
            raise ValueError(
                f"model.lora.target_modules: {lora.target_modules} matches no linear layer of the model "
                f"(the output head is left out); its layers are named {_layer_names(model)}"
            )
    else:
        missing = [t for t in lora.target_modules if t not in names]
        if missing:
            raise ValueError(
                f"model.lora.target_modules: {missing} match no module of the model; its layers are named "
                f"{_layer_names(model)}"
            )
    # peft matches modules_to_save against the end of each module's full name.
    full = [name for name, _ in model.named_modules() if name]
    unknown = [s for s in lora.modules_to_save if not any(n == s or n.endswith("." + s) for n in full)]
    if unknown:
        raise ValueError(
            f"model.lora.modules_to_save: {unknown} match no module of the model; its modules are named "
            f"{', '.join(sorted({n.rsplit('.', 1)[-1] for n in full if not n[-1].isdigit()})[:20])}"
        )


def init_adapters(named_modules: Iterable[tuple[str, torch.nn.Module]], seed: int) -> None:
    """Each LoRA layer's A drawn as peft draws it (uniform within 1/sqrt(fan-in)), from a generator seeded
    by `seed` and the layer's transformers name, and its B zero: the same adapters whatever builds them (the
    whole model, or a pipeline stage that makes only its own layers real), where peft's draws follow the
    order the modules are wrapped in."""
    from peft.tuners.lora import LoraLayer

    for name, module in named_modules:
        if not isinstance(module, LoraLayer):
            continue
        for adapter, a in module.lora_A.items():
            draw = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}/{adapter}".encode()))
            bound = 1 / math.sqrt(a.weight[0].numel())
            with torch.no_grad():
                a.weight.copy_(torch.empty(a.weight.shape).uniform_(-bound, bound, generator=draw))
                module.lora_B[adapter].weight.zero_()


def apply_lora(
    model: torch.nn.Module, lora: Any, *, seed: int | None = None, activation_checkpointing: bool = False
) -> torch.nn.Module:
    """`model` wrapped with the adapters of `lora`; `seed`: their initial values by `init_adapters` (None:
    peft's, for a structure whose values are loaded next)."""
    from peft import get_peft_model

    _check_targets(model, lora)
    with base_weights_gathered_for_peft(model):
        wrapped = get_peft_model(model, peft_config(lora, model))
    if seed is not None and not next(model.parameters()).is_meta:
        init_adapters(wrapped.get_base_model().named_modules(), seed)
    if activation_checkpointing and hasattr(wrapped, "enable_input_require_grads"):
        # With a frozen embedding, checkpointed blocks would otherwise see inputs without gradients.
        wrapped.enable_input_require_grads()
    return wrapped
