"""What LLaMA-Factory's mapped keys become: one function a key (or a few keys read together), each
writing elastictrain keys into the Reading, noting what differs, or refusing a value it cannot honour."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastictrain.config.llamafactory.reading import Reading, comma_list


def to(key: str) -> Callable[[Any, Reading], None]:
    return lambda value, r: r.set(key, value)


def lora_target(value: Any, r: Reading) -> None:
    names = comma_list(value)
    r.set("model.lora.target_modules", "all-linear" if names in (["all"], []) else names)


def lora_alpha(value: Any, r: Reading) -> None:
    r.set("model.lora.alpha", float(value if value is not None else 2 * int(r.get("lora_rank"))))


def modules_to_save(value: Any, r: Reading) -> None:
    r.set("model.lora.modules_to_save", comma_list(value))


def finetuning(value: Any, r: Reading) -> None:
    if value not in ("lora", "full"):
        r.refuse(
            "finetuning_type",
            "expected lora or full (freeze and oft are not supported: train LoRA, or full with a smaller "
            "learning rate)",
        )
    r.set("model.lora.enabled", value == "lora")


def cutoff(value: Any, r: Reading) -> None:
    r.set("data.seq_len", int(value))


def packing(value: Any, r: Reading) -> None:
    if is_preference(r):  # LLaMA-Factory packs stage pt and sft records only
        if value or r.get("neat_packing"):
            r.note(f"packing: no effect at stage {r.get('stage')} (preference records are not packed)")
        r.set("data.packing", False)
        return
    packed = bool(value) if value is not None else r.get("stage") == "pt"
    packed = packed or bool(r.get("neat_packing"))
    r.set("data.packing", packed)


def precision(value: Any, r: Reading) -> None:
    bf16, fp16 = bool(r.get("bf16")), bool(r.get("fp16"))
    if bf16 and fp16:
        r.refuse("fp16", "and bf16: true; expected at most one of them")
    r.set("training.precision", "bf16" if bf16 else "fp16" if fp16 else "fp32")


# transformers' scheduler names and elastictrain's schedule (HF's decays end at 0: min_lr 0).
SCHEDULES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}


def schedule(value: Any, r: Reading) -> None:
    kwargs = r.get("lr_scheduler_kwargs") or {}
    lr = float(r.get("learning_rate"))
    if value == "cosine_with_min_lr":
        if "min_lr" in kwargs:
            r.set("training.min_lr", float(kwargs["min_lr"]))
        elif "min_lr_rate" in kwargs:
            r.set("training.min_lr", lr * float(kwargs["min_lr_rate"]))
        else:
            r.refuse("lr_scheduler_kwargs", "cosine_with_min_lr needs min_lr or min_lr_rate in it")
        r.set("training.lr_schedule", "cosine")
        return
    if value not in SCHEDULES:
        r.refuse(
            "lr_scheduler_type",
            f"expected one of {', '.join([*SCHEDULES, 'cosine_with_min_lr'])} (the schedules elastictrain "
            "computes; training.lr_schedule)",
        )
        return
    r.set("training.lr_schedule", SCHEDULES[value])
    r.set("training.min_lr", 0.0)


def warmup(value: Any, r: Reading) -> None:
    steps, ratio = r.get("warmup_steps") or 0, r.get("warmup_ratio") or 0.0
    if 0 < float(steps) < 1:  # transformers 5: a float below 1 is a ratio
        ratio, steps = float(steps), 0
    if r.get("lr_scheduler_type") == "constant" and (steps or ratio):
        r.note("lr_scheduler_type constant: transformers' constant schedule has no warm-up; none is applied")
        steps, ratio = 0, 0.0
    if int(steps) > 0 or not ratio:  # transformers: warmup_steps wins over warmup_ratio
        r.set("training.warmup_steps", int(steps))
    else:  # warmup_steps = ceil(ratio x steps) when the run starts, as transformers computes it
        r.set("training.warmup_ratio", float(ratio))


def length(value: Any, r: Reading) -> None:
    steps = int(r.get("max_steps"))
    if steps > 0:  # transformers: max_steps wins over num_train_epochs
        r.set("training.max_steps", steps)
        r.set("training.num_epochs", None)
    else:
        r.set("training.num_epochs", float(r.get("num_train_epochs")))


def optim(value: Any, r: Reading) -> None:
    if value not in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"):
        r.refuse("optim", "expected adamw_torch (AdamW, what elastictrain's DeepSpeed engine runs)")


def report_to(value: Any, r: Reading) -> None:
    targets = set(comma_list(value)) - {"none", "mlflow"}
    if targets:
        r.note(
            f"report_to {', '.join(sorted(targets))}: not sent there; every run is one MLflow run "
            "(tracking.uri; by default a SQLite store in the run folder)"
        )


def save_limit(value: Any, r: Reading) -> None:
    if value is None:
        r.note(
            "save_total_limit not set: LLaMA-Factory keeps every checkpoint; elastictrain keeps the last 2 "
            "(checkpoint.keep_last), each resumable at any world size"
        )
    else:
        r.set("checkpoint.keep_last", max(1, int(value)))


def save_strategy(value: Any, r: Reading) -> None:
    if value not in ("steps",):
        r.refuse("save_strategy", "expected steps (checkpoint.every_steps = save_steps)")


def do_train(value: Any, r: Reading) -> None:
    if value is not True:
        r.refuse("do_train", "nothing would train (LLaMA-Factory's default is false); set do_train: true")


def system(value: Any, r: Reading) -> None:
    if value is not None:
        r.set("data.system", str(value))


def mix(value: Any, r: Reading) -> None:
    if value != "concat":
        r.refuse("mix_strategy", "expected concat: datasets are trained on in the order named")


def tool_format(value: Any, r: Reading) -> None:
    if value is None:
        return
    known = {"qwen": "qwen"}
    if value not in known:
        r.refuse(
            "tool_format",
            "elastictrain renders tool calls with the model's own chat template, or data.tool_format json | "
            "qwen; expected qwen (or leave it out)",
        )
        return
    r.set("data.tool_format", known[value])


def eval_split(value: Any, r: Reading) -> None:
    if float(value or 0) > 0:
        r.refuse(
            "val_size",
            "LLaMA-Factory validates on the whole held-out set; give elastictrain's eval.split=FRACTION with "
            "eval.steps=N (global batches per validation) and eval.every_steps=M instead",
        )


# --- preference training (stage dpo, kto)

PREFERENCE_STAGES = ("dpo", "kto")
# pref_loss at stage dpo -> (training.objective, preference.dpo_loss); LLaMA-Factory's default is sigmoid.
PREF_LOSSES: dict[str, tuple[str, str | None]] = {
    "sigmoid": ("dpo", "sigmoid"),
    "hinge": ("dpo", "hinge"),
    "ipo": ("dpo", "ipo"),
    "orpo": ("orpo", None),
    "simpo": ("simpo", None),
}
# The preference numbers: the preference.* key each becomes, and where it is read, by pref_loss (stage
# dpo) or "kto" (stage kto), as LLaMA-Factory's trainers read it.
PREFERENCE_NUMBERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pref_beta": ("preference.beta", (*PREF_LOSSES, "kto")),
    "pref_ftx": ("preference.ftx", (*PREF_LOSSES, "kto")),  # KTO: on desirable answers
    "dpo_label_smoothing": ("preference.label_smoothing", ("sigmoid",)),
    "simpo_gamma": ("preference.simpo_gamma", ("simpo",)),
    "kto_chosen_weight": ("preference.kto_desirable_weight", ("kto",)),
    "kto_rejected_weight": ("preference.kto_undesirable_weight", ("kto",)),
}
REFERENCE_KEYS = ("ref_model", "ref_model_adapters", "ref_model_quantization_bit")
_STARTING_MODEL = (
    "elastictrain's reference is the starting model itself, model_name_or_path (preference.reference: "
    "with LoRA the model with its adapters off, in the step; for a full fine-tune its log-probabilities "
    "computed once before the first step and kept in the run folder)"
)


def is_preference(r: Reading) -> bool:
    return r.get("stage") in PREFERENCE_STAGES


def _mode(r: Reading) -> str:
    """What reads the preference keys: pref_loss at stage dpo, kto at stage kto."""
    return "kto" if r.get("stage") == "kto" else str(r.get("pref_loss"))


def _given(names: Any, r: Reading) -> list[str]:
    """The names given a value other than LLaMA-Factory's default."""
    return [n for n in names if r.was_given(n) and r.get(n) != r.defaults.get(n)]


def preference(value: Any, r: Reading) -> None:
    """pref_loss (with stage) as training.objective, and the preference numbers that objective reads."""
    if not is_preference(r):
        for name in _given([*PREFERENCE_NUMBERS, "pref_loss", *REFERENCE_KEYS], r):
            r.note(f"{name}: no effect at stage {r.get('stage')} (read at stage dpo and kto)")
        return
    if r.get("stage") == "kto":
        r.set("training.objective", "kto")
        if _given(["pref_loss"], r):
            r.note("pref_loss: no effect at stage kto (LLaMA-Factory reads it at stage dpo)")
    elif value not in PREF_LOSSES:
        r.refuse(
            "pref_loss",
            "expected sigmoid, hinge or ipo (training.objective dpo, preference.dpo_loss), orpo or simpo "
            "(training.objective orpo, simpo)" + ("; for KTO give stage: kto" if value == "kto_pair" else ""),
        )
        return
    else:
        objective, dpo_loss = PREF_LOSSES[value]
        r.set("training.objective", objective)
        if dpo_loss is not None:
            r.set("preference.dpo_loss", dpo_loss)
    for name in PREFERENCE_NUMBERS:
        _preference_number(name, r)


def _preference_number(name: str, r: Reading) -> None:
    key, read_by = PREFERENCE_NUMBERS[name]
    number = _number(name, r)
    if number is None:
        return
    if _mode(r) in read_by:
        r.set(key, number)
    elif number != r.defaults.get(name):
        _not_read(name, r)


def _not_read(name: str, r: Reading) -> None:
    """A preference number given where elastictrain's objective does not read it."""
    where = "stage kto" if r.get("stage") == "kto" else f"pref_loss {r.get('pref_loss')}"
    if name == "dpo_label_smoothing" and r.get("stage") == "dpo":  # as LLaMA-Factory's own check
        r.refuse(name, "valid with pref_loss sigmoid only (LLaMA-Factory refuses it with other losses too)")
    else:
        r.note(f"{name}: no effect with {where} (LLaMA-Factory does not read it there either)")


def _number(name: str, r: Reading) -> float | None:
    value = r.get(name)
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    except (TypeError, ValueError):
        r.refuse(name, "expected a number")
        return None


def reference(value: Any, r: Reading) -> None:
    """ref_model (ref_model_adapters, ref_model_quantization_bit with it): LLaMA-Factory's separate
    reference model, read where the objective has a reference (pref_loss sigmoid, hinge, ipo; stage kto)."""
    if not is_preference(r):
        return  # said by preference()
    if r.get("pref_loss") in ("orpo", "simpo") and r.get("stage") == "dpo":
        for name in _given(REFERENCE_KEYS, r):
            r.note(f"{name}: no effect with pref_loss {r.get('pref_loss')} (no reference model)")
        return
    if value is None:
        for name in _given(REFERENCE_KEYS[1:], r):
            r.note(f"{name}: no effect without ref_model (LLaMA-Factory reads it only with ref_model)")
        return
    if not _same_model(str(value), r):
        r.refuse("ref_model", f"another reference model is not supported: {_STARTING_MODEL}; leave it out")
    the_start = "the reference is model_name_or_path as it starts training (preference.reference)"
    if r.get("ref_model_adapters") is not None:
        r.refuse("ref_model_adapters", f"a reference with adapters is not supported: {the_start}")
    if r.get("ref_model_quantization_bit") is not None:
        r.refuse("ref_model_quantization_bit", f"a quantized reference is not supported: {the_start}")


def _same_model(ref: str, r: Reading) -> bool:
    """ref_model names model_name_or_path: the same name, or the folder it resolved to."""
    if ref == str(r.get("model_name_or_path")):
        return True
    return r.model_path is not None and r.path(ref) == r.model_path


def lora_dropout(value: Any, r: Reading) -> None:
    """model.lora.dropout; 0 at stage dpo and kto, where LLaMA-Factory turns dropout off (TRL's
    disable_dropout_in_model, LoRA's dropout included)."""
    if is_preference(r) and value:
        r.note(
            f"lora_dropout: {value} has no effect at stage {r.get('stage')}: LLaMA-Factory trains preference "
            "stages with dropout off; model.lora.dropout 0"
        )
        value = 0.0
    r.set("model.lora.dropout", value)


def answer_only(name: str) -> Callable[[Any, Reading], None]:
    """train_on_prompt, mask_history: which tokens an instruction record trains (data.NAME); preference
    records train their answers only (LLaMA-Factory's pairwise and KTO records read neither)."""

    def apply(value: Any, r: Reading) -> None:
        if not is_preference(r):
            r.set(f"data.{name}", value)
        elif value:
            stage = r.get("stage")
            r.note(f"{name}: no effect at stage {stage} (preference records train their answers only)")

    return apply
