"""Check a loaded config's values together, before any actor starts.

Every problem is reported at once, one line each, naming the full dotted field, the bad value and
what would be valid.
"""

from __future__ import annotations

import glob
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastictrain.config.data_check import sft_problems
from elastictrain.config.errors import ConfigError
from elastictrain.config.eval_check import eval_problems
from elastictrain.config.layout_check import ATTENTION_KERNELS, AUTO, auto_layout_problems, micro_batch_cap
from elastictrain.config.length import length_pending, length_problems
from elastictrain.config.lora_check import lora_problems
from elastictrain.config.objective_check import objective_problems
from elastictrain.config.pipeline_check import fixed_stages, pipeline_problems
from elastictrain.config.schema import Config
from elastictrain.config.tensor_parallel_check import (
    adopt_user_json_tensor_parallel,
    checked_degree,
    tensor_parallel_problems,
)
from elastictrain.core.batch import workable_world_sizes
from elastictrain.core.zero import stage_problems
from elastictrain.data.hf_files import DATA_FORMATS
from elastictrain.data.token_index import index_problems
from elastictrain.storage import url_problems

log = logging.getLogger("elastictrain.config")

# "package.module:attr", the form every user-code field takes (also "module:Class.method").
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")

# scaling.worker_allocator's choices (cluster/allocator.py preloads them into the workers)
ALLOCATORS = ("jemalloc", "system")


def _choice(problems: list[str], key: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        problems.append(f"{key}: got {value!r}; expected one of {', '.join(map(str, choices))}")


def _at_least(problems: list[str], key: str, value: float, low: float, *, strict: bool = False) -> None:
    if (value <= low) if strict else (value < low):
        problems.append(f"{key}: got {value!r}; expected a number {'>' if strict else '>='} {low}")


def validate(config: Config) -> Config:
    p: list[str] = []
    t, d, s, ds, ck, f = (
        config.training,
        config.data,
        config.scaling,
        config.deepspeed,
        config.checkpoint,
        config.failure,
    )
    hf = config.model.hf_config
    if not config.run.name or "/" in config.run.name:
        p.append(f"run.name: got {config.run.name!r}; expected a non-empty name without '/'")
    if not config.run.dir:
        p.append("run.dir: got ''; expected a folder path")
    p.extend(url_problems("run.dir", config.run.dir))
    p.extend(_hub_ids(config))
    p.extend(_model_problems(config))
    # The model's own config describes it only when neither a factory nor a pretrained folder is used.
    from_hf_config = not (config.model.factory or config.model.pretrained)
    if (
        from_hf_config
        and "vocab_size" in hf
        and isinstance(hf["vocab_size"], int)
        and hf["vocab_size"] < 256
        and d.source in ("generated", "file")
    ):
        p.append(
            f"model.hf_config.vocab_size: got {hf['vocab_size']}; expected >= 256 (built-in data is bytes)"
        )
    p.extend(_data_problems(config))
    p.extend(eval_problems(config, _data_problems))
    p.extend(length_problems(config))
    _at_least(p, "data.generated_chars", d.generated_chars, 1)
    _at_least(p, "data.seq_len", d.seq_len, 2)
    max_pos = hf.get("max_position_embeddings") if from_hf_config else None
    if isinstance(max_pos, int) and d.seq_len > max_pos:
        p.append(
            f"data.seq_len: got {d.seq_len}; expected <= model.hf_config.max_position_embeddings ({max_pos})"
        )
    _at_least(p, "training.global_batch_size", t.global_batch_size, 1)
    _at_least(
        p, "tracking.system_metrics_interval_s", config.tracking.system_metrics_interval_s, 0, strict=True
    )
    if t.micro_batch_size != AUTO:
        _at_least(p, "training.micro_batch_size", t.micro_batch_size, 1)
    _at_least(p, "training.max_steps", t.max_steps, 1)
    _at_least(p, "training.lr", t.lr, 0, strict=True)
    _at_least(p, "training.min_lr", t.min_lr, 0)
    if t.min_lr > t.lr:
        p.append(f"training.min_lr: got {t.min_lr}; expected <= training.lr ({t.lr})")
    _at_least(p, "training.warmup_steps", t.warmup_steps, 0)
    if t.warmup_steps > t.max_steps and not length_pending(t):
        p.append(
            f"training.warmup_steps: got {t.warmup_steps}; expected <= training.max_steps ({t.max_steps})"
        )
    _choice(p, "training.lr_schedule", t.lr_schedule, ["cosine", "linear", "constant"])
    p.extend(_code_path_problems("training.loss", t.loss))
    p.extend(objective_problems(config))
    _at_least(p, "training.weight_decay", t.weight_decay, 0)
    for key, value in (("training.adam_beta1", t.adam_beta1), ("training.adam_beta2", t.adam_beta2)):
        if not 0 <= value < 1:
            p.append(f"{key}: got {value}; expected a number in [0, 1)")
    _at_least(p, "training.adam_eps", t.adam_eps, 0, strict=True)
    _at_least(p, "training.grad_clip", t.grad_clip, 0)
    _choice(p, "training.precision", t.precision, ["fp32", "bf16", "fp16"])
    _choice(p, "model.attn_implementation", config.model.attn_implementation, ATTENTION_KERNELS)
    _at_least(p, "training.log_every_steps", t.log_every_steps, 1)
    _choice(p, "deepspeed.zero_stage", ds.zero_stage, [0, 1, 2, 3, AUTO])
    if AUTO not in (ds.zero_stage, ds.offload_optimizer, ds.offload_param):
        p.extend(stage_problems(ds.zero_stage, ds.offload_optimizer, ds.offload_param, t.precision))
    _choice(p, "deepspeed.offload_optimizer", ds.offload_optimizer, ["none", "cpu", "nvme", AUTO])
    _choice(p, "deepspeed.offload_param", ds.offload_param, ["none", "cpu", "nvme", AUTO])
    _choice(p, "deepspeed.activation_checkpointing", ds.activation_checkpointing, [True, False, AUTO])
    p.extend(auto_layout_problems(config))
    if "nvme" in (ds.offload_optimizer, ds.offload_param):
        if not ds.nvme_path:
            p.append("deepspeed.nvme_path: missing; expected a writable folder when an offload is 'nvme'")
        elif not Path(ds.nvme_path).is_dir():
            p.append(f"deepspeed.nvme_path: got {ds.nvme_path!r}; expected an existing folder")
        elif not _writable(ds.nvme_path):
            p.append(f"deepspeed.nvme_path: got {ds.nvme_path!r}; expected a folder this user can write")
    if ds.offload_param not in ("none", AUTO) and ds.offload_optimizer == "none":
        p.append(
            "deepspeed.offload_param: offloading parameters needs deepspeed.offload_optimizer "
            "to be cpu or nvme too (a DeepSpeed requirement)"
        )
    adopt_user_json_tensor_parallel(config)
    p.extend(tensor_parallel_problems(config))
    p.extend(pipeline_problems(config))
    _at_least(p, "scaling.min_workers", s.min_workers, 1)
    _at_least(p, "scaling.max_workers", s.max_workers, 1)
    _at_least(p, "scaling.spare_workers", s.spare_workers, 0)
    if s.min_workers > s.max_workers:
        p.append(
            f"scaling.min_workers: got {s.min_workers}; expected <= scaling.max_workers ({s.max_workers})"
        )
    _at_least(p, "scaling.cpus_per_worker", s.cpus_per_worker, 0, strict=True)
    _choice(p, "scaling.worker_allocator", s.worker_allocator, ALLOCATORS)
    _at_least(p, "scaling.keep_warm_s", s.keep_warm_s, 0)
    if s.use_gpu:
        _at_least(p, "scaling.gpus_per_worker", s.gpus_per_worker, 0, strict=True)
    _at_least(p, "checkpoint.every_steps", ck.every_steps, 1)
    _at_least(p, "checkpoint.keep_last", ck.keep_last, 1)
    if ck.max_host_memory_mb is not None:
        _at_least(p, "checkpoint.max_host_memory_mb", ck.max_host_memory_mb, 0)
    _at_least(p, "checkpoint.memory_every_steps", ck.memory_every_steps, 0)
    if not 0 <= ck.memory_max_step_share < 1:
        p.append(
            f"checkpoint.memory_max_step_share: got {ck.memory_max_step_share}; expected a share of step "
            "time >= 0 and < 1 (0.03: snapshots cost at most 3%; 0: every checkpoint.memory_every_steps)"
        )
    _at_least(p, "failure.max_failures", f.max_failures, 0)
    _at_least(p, "failure.hang_timeout_s", f.hang_timeout_s, 0, strict=True)
    _at_least(p, "failure.collective_timeout_s", f.collective_timeout_s, 0, strict=True)
    _at_least(p, "failure.wait_for_capacity_s", f.wait_for_capacity_s, 0)
    _at_least(p, "failure.warmup_timeout_s", f.warmup_timeout_s, 0, strict=True)
    if f.straggler_factor != 0 and f.straggler_factor <= 1:
        p.append(f"failure.straggler_factor: got {f.straggler_factor}; expected 0 (off) or a number > 1")
    _at_least(p, "failure.straggler_steps", f.straggler_steps, 1)
    _at_least(p, "failure.straggler_avoid_s", f.straggler_avoid_s, 0)
    _at_least(p, "failure.max_bad_steps", f.max_bad_steps, 0)
    _at_least(p, "failure.bad_steps_window", f.bad_steps_window, 0)
    if f.loss_spike != 0 and f.loss_spike <= 1:
        p.append(f"failure.loss_spike: got {f.loss_spike}; expected 0 (off) or a factor > 1, e.g. 3")
    _at_least(p, "failure.loss_spike_window", f.loss_spike_window, 3)
    _at_least(p, "tracking.max_spool_mb", config.tracking.max_spool_mb, 0, strict=True)
    p.extend(_tracking_uri_problems(config.tracking.uri))
    if config.ray.num_cpus is not None:
        _at_least(p, "ray.num_cpus", config.ray.num_cpus, 1)
    if not p and not valid_world_sizes(config):
        p.append(_no_world_size_message(config))
    if not p and ds.config_file:
        from elastictrain.config.deepspeed_config import check_user_json

        p.extend(check_user_json(config))
    if p:
        raise ConfigError(p)
    return config


def _code_path_problems(key: str, value: str | None) -> list[str]:
    """A user-code field holds "module:attr", or the label elastictrain.fit() gave a Python object."""
    if value is None or _IMPORT_PATH.match(value) or (value.startswith("<") and value.endswith(">")):
        return []
    return [f"{key}: got {value!r}; expected an import path 'module:attr', e.g. 'mypkg.models:build'"]


def _hub_ids(config: Config) -> list[str]:
    """model.pretrained and data.tokenizer given as hub ids become their cached snapshots (offline)."""
    from elastictrain.config.hub_cache import HubModelMissing, resolve_model

    problems = []
    for section, key in ((config.model, "pretrained"), (config.data, "tokenizer")):
        field = f"{'model' if section is config.model else 'data'}.{key}"
        value = getattr(section, key)
        try:
            found = resolve_model(value, field) if value else None
        except HubModelMissing as e:
            problems.append(str(e))
            continue
        if found is not None:
            setattr(section, key, found.path)
            log.info(found.line(field))
    return problems


def _model_problems(config: Config) -> list[str]:
    m, p = config.model, []
    p.extend(_code_path_problems("model.factory", m.factory))
    if m.factory and m.pretrained:
        p.append(
            f"model.pretrained: got {m.pretrained!r} and model.factory {m.factory!r}; expected only one "
            "of them (model.factory builds the model itself)"
        )
    if m.pretrained and not (Path(m.pretrained) / "config.json").is_file():
        p.append(
            f"model.pretrained: got {m.pretrained!r}; expected a local folder holding a transformers "
            "model (config.json and weights, as written by save_pretrained)"
        )
    if not (m.factory or m.pretrained) and "model_type" not in m.hf_config:
        p.append("model.hf_config.model_type: missing; expected a transformers model type such as 'llama'")
    p.extend(lora_problems(config))
    return p


def _data_problems(config: Config) -> list[str]:
    d, p = config.data, []
    _choice(p, "data.source", d.source, ["generated", "file", "hf", "tokens", "factory", "sft"])
    p.extend(sft_problems(config))  # files, dataset_info.json entries, options (config/data_check.py)
    p.extend(index_problems(d.path, d.dtype) if d.source == "tokens" else [])  # shards against their index
    p.extend(_code_path_problems("data.factory", d.factory))
    p.extend(_code_path_problems("data.collate", d.collate))
    if d.source == "file":
        if not d.path:
            p.append("data.path: missing; expected a UTF-8 text file when data.source is 'file'")
        elif not Path(d.path).is_file():
            p.append(f"data.path: got {d.path!r}; expected an existing text file")
    if d.source == "factory" and not d.factory:
        p.append("data.factory: missing; expected an import path 'module:attr' when data.source is 'factory'")
    if d.factory and d.source != "factory":
        p.append(
            f"data.factory: got {d.factory!r} while data.source is {d.source!r}; set data.source=factory "
            "to use it"
        )
    if d.format is not None:
        _choice(p, "data.format", d.format, ["json", "csv", "parquet", "text"])
    if d.source == "hf":
        if not d.path:
            p.append("data.path: missing; expected local data files (e.g. data/*.jsonl) for data.source 'hf'")
        else:
            files = sorted(glob.glob(d.path))
            if not files:
                p.append(f"data.path: got {d.path!r}; no file matches it")
            elif d.format is None and Path(files[0]).suffix not in DATA_FORMATS:
                p.append(
                    f"data.format: missing and data.path {d.path!r} has no known extension "
                    f"({', '.join(DATA_FORMATS)}); expected one of json, csv, parquet, text"
                )
        if not d.tokenizer:
            p.append("data.tokenizer: missing; expected a local tokenizer folder when data.source is 'hf'")
        elif not Path(d.tokenizer).is_dir():
            p.append(f"data.tokenizer: got {d.tokenizer!r}; expected an existing folder (save_pretrained)")
    return p


def _tracking_uri_problems(uri: str | None) -> list[str]:
    """MLflow's file store (a `file:` URI or a plain folder) no longer opens unless MLFLOW_ALLOW_FILE_STORE
    is set: every record would wait in the spool and `elastictrain sync` would fail the same way."""
    import os
    from urllib.parse import urlparse

    if uri is None or urlparse(uri).scheme not in ("", "file") or uri in ("databricks", "databricks-uc"):
        return []
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true", "yes"):
        return []
    return [
        f"tracking.uri: got {uri!r}; MLflow's file store refuses to open (it is in maintenance mode), "
        "so nothing would reach it. Use sqlite:///PATH/mlflow.db, an MLflow server (http://HOST:PORT), "
        "or leave it unset for a SQLite store in the run folder (MLFLOW_ALLOW_FILE_STORE=true opts back in)"
    ]


def _writable(folder: str) -> bool:
    # A real write, not os.access: root passes os.access on a read-only mount.
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def valid_world_sizes(config: Config) -> list[int]:
    s, t = config.scaling, config.training
    n = checked_degree(config)
    cap = micro_batch_cap(config)
    return workable_world_sizes(
        t.global_batch_size, cap, s.min_workers, s.max_workers, n, fixed_stages(config)
    )


def _no_world_size_message(config: Config) -> str:
    s, t = config.scaling, config.training
    n = checked_degree(config) * fixed_stages(config)
    sizes = [w // n for w in range(s.min_workers, s.max_workers + 1) if w % n == 0]  # replicas
    candidates = [g for g in range(1, 2 * t.global_batch_size + 64) if all(g % w == 0 for w in sizes)]
    nearby = sorted(sorted(candidates, key=lambda g: abs(g - t.global_batch_size))[:4])
    return (
        f"training.global_batch_size: got {t.global_batch_size}; no world size in "
        f"[scaling.min_workers={s.min_workers}, scaling.max_workers={s.max_workers}]"
        + (f" (as {min(sizes)}-{max(sizes)} replicas of {n} ranks)" if n > 1 and sizes else "")
        + " divides it, so it "
        f"cannot be split exactly; global batch sizes that work at every size in range: "
        f"{', '.join(map(str, nearby)) or 'none nearby'}"
    )
