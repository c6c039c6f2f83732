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
