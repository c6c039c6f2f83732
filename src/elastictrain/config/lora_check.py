"""The `model.lora` section's checks when the config is loaded (names against the model: driver/preflight.py).

`target_modules` is a list of layer names or peft's `all-linear` (LLaMA-Factory's `all` means the
same and is accepted as such): see model/lora.py for how each field reaches peft.
"""

from __future__ import annotations

from typing import Any

from elastictrain.storage import is_url

ALL_LINEAR = "all-linear"  # peft's own value: every linear layer but the output head
ALL_LINEAR_SPELLINGS = (ALL_LINEAR, "all")  # "all": LLaMA-Factory's lora_target
_TARGETS_WANTED = (
    "expected a list of layer names such as [q_proj, v_proj] (LLaMA-Factory's 'q_proj,v_proj' is "
    "written [q_proj, v_proj] here), or all-linear (every linear layer but the output head; 'all' too)"
)


def is_all_linear(target_modules: Any) -> bool:
    return isinstance(target_modules, str) and target_modules.lower() in ALL_LINEAR_SPELLINGS


def lora_problems(config: Any) -> list[str]:
    """One line per problem of the `model.lora` section, naming the field, the value and what fits.

    target_modules is typed Any in the schema (a string or a list): its type is checked here, as OmegaConf
    checks every other field's, whether LoRA is enabled or not; the values only when it is.
    """
    lora = config.model.lora
    p: list[str] = []
    targets = lora.target_modules
    if isinstance(targets, list | tuple):
        if not targets:
            p.append(f"model.lora.target_modules: got []; {_TARGETS_WANTED}")
        elif not all(isinstance(t, str) and t for t in targets):
            p.append(f"model.lora.target_modules: got {list(targets)!r}; {_TARGETS_WANTED}")
    elif not is_all_linear(targets):
        p.append(f"model.lora.target_modules: got {targets!r}; {_TARGETS_WANTED}")
    if not lora.enabled:
        return p
    if lora.r < 1:
        p.append(f"model.lora.r: got {lora.r!r}; expected a number >= 1")
    if not lora.alpha > 0:
        p.append(f"model.lora.alpha: got {lora.alpha!r}; expected a number > 0")
    if not 0 <= lora.dropout < 1:
        p.append(f"model.lora.dropout: got {lora.dropout}; expected a number in [0, 1)")
    if not all(lora.modules_to_save):
        p.append(
            f"model.lora.modules_to_save: got {list(lora.modules_to_save)!r}; expected module names "
            "such as [lm_head, embed_tokens]"
        )
    if isinstance(targets, list | tuple):
        both = sorted(set(targets) & set(lora.modules_to_save))
        if both:
            # peft would wrap the same module twice: as an adapter's base and as a trained copy.
            p.append(
                f"model.lora.modules_to_save: {both} are also in model.lora.target_modules; expected each "
                "module in one of them (adapted by LoRA, or trained in full)"
            )
    if not lora.export_dir:
        p.append("model.lora.export_dir: got ''; expected a folder path")
    elif is_url(lora.export_dir):  # peft writes a local folder
        p.append(f"model.lora.export_dir: got {lora.export_dir!r}; expected a local folder path")
    return p
