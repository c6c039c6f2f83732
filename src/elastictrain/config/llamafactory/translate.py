"""A LLaMA-Factory training YAML (with `key=value` overrides) as an elastictrain config.

`llamafactory-cli train FILE key=value` takes overrides in the file's own keys; elastictrain's dotted
keys (`scaling.max_workers=8`) go beside them and apply last. Every key is read with LLaMA-Factory's
meaning, and its default where it is not given (keys.py), so the same file means the same training.
What has no effect here, and what differs, is said at start; what cannot be honoured is refused by name.
"""

from __future__ import annotations

import difflib
import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.config.llamafactory.convert import PREFERENCE_STAGES
from elastictrain.config.llamafactory.keys import BY_NAME, KEYS, MARKERS, NO_EFFECT, REFUSED
from elastictrain.config.llamafactory.reading import Reading, comma_list
from elastictrain.config.llamafactory.templates import read_template

# LLaMA-Factory's stage -> data.source (dpo and kto: preference records; training.objective: convert.py)
STAGES = {"sft": "sft", "pt": "hf", "dpo": "sft", "kto": "sft"}
CHAT_STAGES = ("sft", *PREFERENCE_STAGES)  # records rendered with a chat template
LATER_STAGES = {"rm": "reward modelling", "ppo": "PPO"}
SECTIONS = (
    "run",
    "model",
    "data",
    "eval",
    "training",
    "preference",
    "deepspeed",
    "scaling",
    "checkpoint",
    "tracking",
)


@dataclass
class Translation:
    """The config as elastictrain reads it (nested, before validation), and what was said of the file."""

    native: dict[str, Any]
    overrides: list[str]  # elastictrain's own dotted overrides, applied over `native`
    notices: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fresh: bool = False  # overwrite_output_dir: a run already in output_dir is moved aside


def is_llamafactory(raw: Any) -> bool:
    """A LLaMA-Factory file: flat keys such as `stage` and `model_name_or_path`, no elastictrain section."""
    # `deepspeed: FILE` is LLaMA-Factory's; elastictrain's sections are mappings.
    if not isinstance(raw, dict) or any(k in SECTIONS and isinstance(v, dict) for k, v in raw.items()):
        return False
    return any(k in raw for k in MARKERS)


def gpus_here() -> int:
    """GPUs on this machine, as torchrun would start a process on each (no torch import)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


def translate(
    raw: dict[str, Any], overrides: Sequence[str] = (), cwd: Path | None = None, gpus: int | None = None
) -> Translation:
    """`raw` (the file's mapping) with `overrides`, read as LLaMA-Factory reads it."""
    given, native_overrides, problems = _split_overrides(dict(raw), overrides)
    r = Reading(given, cwd or Path.cwd(), defaults={k.name: k.default for k in KEYS})
    r.problems.extend(problems)
    for name in given:
        if name not in BY_NAME:
            close = difflib.get_close_matches(name, list(BY_NAME), n=1)
            hint = (
                f"did you mean {close[0]!r}?" if close else "docs/reference/llamafactory-keys.md lists them"
            )
            r.problems.append(f"{name}: not a LLaMA-Factory key elastictrain reads; {hint}")
    for key in KEYS:
        if key.kind == REFUSED and r.was_given(key.name) and r.get(key.name) != key.default:
            r.refuse(key.name, f"not supported: {key.note}")
        elif key.kind == NO_EFFECT and r.was_given(key.name) and r.get(key.name) != key.default:
            r.note(f"{key.name}: no effect here ({key.note})")
    _stage(r)
    _model(r)
    _world_size(r, native_overrides, gpus_here() if gpus is None else gpus)
    for key in KEYS:
        if key.apply is not None and key.kind not in (REFUSED, NO_EFFECT):
            key.apply(r.get(key.name), r)
    _output(r)
    _deepspeed(r)
    _data(r)
    read_template(r.get("template") if r.get("stage") in CHAT_STAGES else None, r)
    fresh = bool(r.get("overwrite_output_dir"))
    if fresh:
        r.note(
            "overwrite_output_dir: true: a run already in output_dir is moved aside (kept, not deleted) and "
            "training starts over; false would continue it"
        )
    return Translation(_nested(r.native), native_overrides, r.notices, r.problems, fresh)


def _split_overrides(
    given: dict[str, Any], overrides: Sequence[str]
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The file's own keys (`lora_rank=16`) merged into `given`; dotted elastictrain keys kept apart."""
    from omegaconf import OmegaConf

    native, problems = [], []
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or "." in key:
            native.append(item)  # elastictrain's own (load_config reports a malformed one)
            continue
        try:
            given.update(OmegaConf.to_container(OmegaConf.from_dotlist([item])))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - OmegaConf's grammar errors come in several types
            problems.append(f"override {item!r}: {e}")
    return given, native, problems


def _stage(r: Reading) -> None:
    stage = r.get("stage")
    if stage in LATER_STAGES:
        trained = ", ".join(STAGES)
        r.refuse("stage", f"{LATER_STAGES[stage]} is not supported yet; elastictrain trains stage {trained}")
    elif stage not in STAGES:
        kinds = "supervised fine-tuning, pre-training, preference training"
        r.refuse("stage", f"expected one of {', '.join(STAGES)} ({kinds})")
    else:
        r.set("data.source", STAGES[stage])


def _model(r: Reading) -> None:
    from elastictrain.config.hub_cache import HubModelMissing, resolve_model

    ref = r.get("model_name_or_path")
    if not ref:
        r.problems.append(
            "model_name_or_path: missing; expected a model folder or a hub id in the local cache"
        )
        return
    cache = r.get("cache_dir")
    try:
        found = resolve_model(str(ref), "model_name_or_path", str(r.get("model_revision")), cache=cache)
    except HubModelMissing as e:
        r.problems.append(str(e))
        return
    if found is not None:
        r.note(found.line("model_name_or_path"))
    r.model_path = found.path if found else r.path(str(ref))
    r.set("model.pretrained", r.model_path)


def _world_size(r: Reading, native_overrides: list[str], gpus: int) -> None:
    """The world size the run starts at: ray_num_workers, else scaling.max_workers, else the GPUs here."""
    given_max = next(
        (o.split("=", 1)[1] for o in native_overrides if o.startswith("scaling.max_workers=")), None
    )
    if r.was_given("ray_num_workers"):
        world, why = int(r.get("ray_num_workers")), "ray_num_workers"
    elif given_max is not None and given_max.strip().isdigit():
        world, why = int(given_max), "scaling.max_workers"
    elif gpus > 0:
        world, why = gpus, f"this machine's {gpus} GPU(s), as llamafactory-cli starts a process on each"
    else:
        world, why = 1, "no GPU here: one worker, as llamafactory-cli runs one process"
    r.world_size = max(1, world)
    micro, accumulation = int(r.get("per_device_train_batch_size")), int(r.get("gradient_accumulation_steps"))
    batch = micro * accumulation * r.world_size
    r.set("training.micro_batch_size", micro)
    r.set("training.global_batch_size", batch)
    r.set("scaling.max_workers", r.world_size)
    r.set("scaling.min_workers", 1)
    if gpus > 0:
        r.set("scaling.use_gpu", True)
    r.note(
        f"global batch {batch} = per_device_train_batch_size {micro} x gradient_accumulation_steps "
        f"{accumulation} x {r.world_size} worker(s) at start ({why}); it stays {batch} at every world size "
        f"(scaling.min_workers=1 to scaling.max_workers={r.world_size} unless given)"
    )


def _output(r: Reading) -> None:
    out = r.get("output_dir") or "trainer_output"  # transformers' default
    r.set("run.dir", r.path(out))
    name = r.get("run_name") or r.get("ray_run_name") or Path(r.path(out)).name
    r.set("run.name", str(name).replace("/", "-"))
    if r.get("finetuning_type") == "lora":
        r.set("model.lora.export_dir", "${run.dir}")  # the adapter at output_dir's top, as LLaMA-Factory's


def _deepspeed(r: Reading) -> None:
    ds = r.get("deepspeed")
    if not ds:
        # LLaMA-Factory without a DeepSpeed file trains plain data parallel (DDP); ZeRO-1 computes the same
        # update, and its checkpoints are elastic in bf16 and fp16 too (stage 0's are not).
        r.set("deepspeed.zero_stage", 1)
        return
    path = r.path(str(ds))
    r.set("deepspeed.config_file", path)
    try:
        user = json.loads(Path(path).read_text())
        stage = user.get("zero_optimization", {}).get("stage", 0)
    except (OSError, ValueError, AttributeError):
        return  # reported by the DeepSpeed JSON check, naming deepspeed.config_file
    if stage in (0, 1, 2, 3):
        r.set("deepspeed.zero_stage", stage)


def _data(r: Reading) -> None:
    dataset_dir = str(r.get("dataset_dir"))
    if dataset_dir.startswith("REMOTE:"):
        r.refuse("dataset_dir", "a hub dataset folder; download it and give the local folder")
        return
    names = comma_list(r.get("dataset"))
    if not names:
        r.problems.append("dataset: missing; expected names of dataset_dir's dataset_info.json ('a,b')")
        return
    if r.get("stage") in CHAT_STAGES:
        r.set("data.dataset_dir", r.path(dataset_dir))
        r.set("data.dataset", names)
    elif r.get("stage") == "pt":
        _text_dataset(r, r.path(dataset_dir), names)


def _text_dataset(r: Reading, dataset_dir: str, names: list[str]) -> None:
    """stage pt: one dataset_info.json entry's text column, packed into cutoff_len blocks."""
    from elastictrain.data.sft.dataset_info import read_info

    if len(names) > 1:
        r.refuse("dataset", "stage pt reads one dataset here; join the text files into one entry")
        return
    info, problem = read_info(dataset_dir)
    if info is None:
        r.problems.append(f"dataset_dir: {problem}")
        return
    entry = info.get(names[0])
    if not isinstance(entry, dict) or not entry.get("file_name"):
        r.problems.append(
            f"dataset: {names[0]!r} is not an entry with file_name in {dataset_dir}/dataset_info.json"
        )
        return
    target = Path(dataset_dir) / str(entry["file_name"])
    r.set("data.path", str(target / "*") if target.is_dir() else str(target))
    r.set("data.text_field", (entry.get("columns") or {}).get("prompt") or "instruction")  # alpaca's default
    r.set("data.tokenizer", r.model_path)
    if r.was_given("template"):
        r.note(
            "template: no effect at stage pt (plain text trains as it is, an end-of-text token after each)"
        )


def _nested(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
