"""The DeepSpeed config for one attempt: generated from elastictrain's settings, or the user's JSON with
Hugging Face style "auto" values resolved.

elastictrain always sets the per-rank batch fields (they change with the world size) and owns the LR
schedule (`training.lr_schedule`, a pure function of the step), so DeepSpeed gets no scheduler block.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from elastictrain.config.schema import Config
from elastictrain.config.tensor_parallel_check import user_json_tensor_parallel
from elastictrain.core.zero import stage_problems

SCHEDULERS_REPLACED = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
# Optimizers whose state is not elementwise per parameter element (so not resharded by slicing).
UNRESHARDABLE_OPTIMIZERS = {
    "onebitadam": "per-rank error-feedback buffers",
    "zerooneadam": "per-rank error-feedback buffers",
    "onebitlamb": "per-rank error-feedback buffers and scaling coefficients",
}


def _hidden(config: Config) -> int:
    return int(config.model.hf_config.get("hidden_size", 1024))


NVME_SUB_GROUP = 50_000_000
MIN_BUCKET = 1 << 22  # elements: below this, buckets only add collective calls on small models
MAX_BUCKET = 500_000_000  # DeepSpeed's own default


def live_parameters(config: Config) -> int:
    """ZeRO-3's bound on gathered parameters (and on the reuse distance that keeps them gathered): about
    twenty hidden^2, two layers of a Llama. DeepSpeed's default (1e9) keeps a whole 1B model gathered
    through a backward pass with activation checkpointing: 4 GB of fp32 per rank on top of its partition."""
    h = _hidden(config)
    return min(1_000_000_000, max(10_000_000, 20 * h * h))


def _bucket_sizes(config: Config) -> dict[str, int]:
    """Gradient-reduce and parameter-prefetch buckets sized to the model (the Hugging Face recipe:
    hidden^2 and 0.9 hidden^2), and the live-parameter bound. DeepSpeed's defaults (5e8 and 5e7
    elements) fill 2 GB of fp32 reduce bucket per rank on a 1B model: a 2-rank CPU run of the 1B preset
    went out of memory with them."""
    h = _hidden(config)
    return {
        "reduce_bucket_size": min(MAX_BUCKET, max(MIN_BUCKET, h * h)),
        "stage3_prefetch_bucket_size": min(MAX_BUCKET, max(MIN_BUCKET, int(0.9 * h * h))),
        "stage3_max_live_parameters": live_parameters(config),
        "stage3_max_reuse_distance": live_parameters(config),
    }  # elements of fp32 master, gradient and Adam state swapped in together


def _largest_param(config: Config) -> int:
    hf = config.model.hf_config
    h = _hidden(config)
    return max(int(hf.get("vocab_size", 0)) * h, int(hf.get("intermediate_size", 0)) * h, h * h)


def _offload_block(device: str, config: Config, *, param: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device, "pin_memory": False}
    if device == "nvme":
        block["nvme_path"] = config.deepspeed.nvme_path
        if param:
            # DeepSpeed's default swap buffers (5 x 1e8 elements) cost seconds to allocate per engine;
            # they need only hold the largest parameter.
            block["buffer_count"] = 5
            block["buffer_size"] = max(_largest_param(config), 1_000_000)
    return block


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def _generated(config: Config) -> dict[str, Any]:
    t, ds = config.training, config.deepspeed
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "stage3_gather_16bit_weights_on_model_save": False,
        **_bucket_sizes(config),
    }
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_block(ds.offload_optimizer, config, param=False)
    if ds.offload_optimizer == "nvme":
        # ZeRO-3 swaps the optimizer in one sub-group at a time: DeepSpeed's default (1e9 elements) would
        # bring a whole 1B model's state back into host memory; 5e7 bounds it to ~0.8 GB.
        zero["sub_group_size"] = NVME_SUB_GROUP
    if ds.offload_param != "none":
        zero["offload_param"] = _offload_block(ds.offload_param, config, param=True)
    cfg: dict[str, Any] = {"zero_optimization": zero}
    if t.precision == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    elif t.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if "nvme" in (ds.offload_optimizer, ds.offload_param):
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    if ds.activation_checkpointing:
        # The model side enables HF gradient checkpointing; this block documents DeepSpeed's defaults.
        cfg["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return cfg


def _adamw(config: Config, *, offloaded: bool) -> dict[str, Any]:
    """AdamW from training.*; DeepSpeed picks its CPU Adam when the optimizer state is offloaded."""
    t = config.training
    params: dict[str, Any] = {
        "lr": t.lr,
        "betas": [t.adam_beta1, t.adam_beta2],
        "eps": t.adam_eps,
        "weight_decay": t.weight_decay,
    }
    if not offloaded:
        params["torch_adam"] = True  # torch's AdamW: no FusedAdam to JIT-compile, and it runs on CPU
        # Its fused kernel (CPU and CUDA) updates in one pass; the default on CPU, one tensor at a time,
        # allocates two temporaries the size of the rank's whole partition (ZeRO's flat group) per step.
        params["fused"] = True
    return {"type": "AdamW", "params": params}


def _enabled(user: dict[str, Any], block: str, auto: bool) -> bool:
    value = user.get(block, {}).get("enabled", "auto") if isinstance(user.get(block), dict) else False
    return auto if value == "auto" else bool(value)


def _offload_devices(zero: dict[str, Any]) -> tuple[str, str]:
    def device(name: str) -> str:
        block = zero.get(name)
        return str(block.get("device", "none")) if isinstance(block, dict) else "none"

    return device("offload_optimizer"), device("offload_param")


def _read_user_json(config: Config) -> dict[str, Any]:
    path = Path(config.deepspeed.config_file or "")
    return json.loads(path.read_text())


def _resolve_auto(node: Any, values: dict[str, Any], path: str, unresolved: list[str]) -> Any:
    if isinstance(node, dict):
        return {
            k: _resolve_auto(v, values, f"{path}.{k}" if path else k, unresolved) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_resolve_auto(v, values, f"{path}[{i}]", unresolved) for i, v in enumerate(node)]
    if node == "auto":
        if path in values:
            return values[path]
        unresolved.append(path)
    return node


def _auto_values(config: Config, micro: int, accum: int) -> dict[str, Any]:
    t = config.training
    h = _hidden(config)
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": t.grad_clip,
        "optimizer.params.lr": t.lr,
        "optimizer.params.betas": [t.adam_beta1, t.adam_beta2],
        "optimizer.params.eps": t.adam_eps,
        "optimizer.params.weight_decay": t.weight_decay,
        "fp16.enabled": t.precision == "fp16",
        "bf16.enabled": t.precision == "bf16",
        "zero_optimization.reduce_bucket_size": h * h,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * h * h),
        "zero_optimization.stage3_param_persistence_threshold": 10 * h,
    }


def check_user_json(config: Config) -> list[str]:
    """Problems with deepspeed.config_file: unreadable, or conflicting with elastictrain's settings."""
    key = "deepspeed.config_file"
    path = Path(config.deepspeed.config_file or "")
    if not path.is_file():
        return [f"{key}: got {str(path)!r}; expected an existing DeepSpeed JSON file"]
    try:
        user = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{key}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"]
    if not isinstance(user, dict):
        return [f"{key}: {path} must hold a JSON object"]
    t = config.training
    problems = []
    tbs = user.get("train_batch_size", "auto")
    if tbs != "auto" and tbs != t.global_batch_size:
        problems.append(
            f"{key}: train_batch_size is {tbs} in {path.name} but training.global_batch_size is "
            f'{t.global_batch_size}; set it to "auto" or {t.global_batch_size}'
        )
    micro = user.get("train_micro_batch_size_per_gpu", "auto")
    if micro != "auto" and micro != t.micro_batch_size:
        problems.append(
            f"{key}: train_micro_batch_size_per_gpu is {micro} in {path.name} but "
            f'training.micro_batch_size is {t.micro_batch_size}; set it to "auto" (elastictrain '
            "recomputes it at every world size)"
        )
    for name, want in (("fp16", t.precision == "fp16"), ("bf16", t.precision == "bf16")):
        enabled = user.get(name, {}).get("enabled", "auto") if isinstance(user.get(name), dict) else "auto"
        if enabled != "auto" and bool(enabled) != want:
            problems.append(
                f"{key}: {name}.enabled is {str(enabled).lower()} in {path.name} but "
                f'training.precision is {t.precision}; set it to "auto" or match training.precision'
            )
    sched = user.get("scheduler")
    if isinstance(sched, dict) and sched.get("type") not in SCHEDULERS_REPLACED:
        problems.append(
            f"{key}: scheduler type {sched.get('type')!r} is not supported; elastictrain owns the LR "
            f"schedule (training.lr_schedule); use one of {', '.join(sorted(SCHEDULERS_REPLACED))} "
            "or remove the block"
        )
    opt = user.get("optimizer")
    opt_type = str(opt.get("type", "")) if isinstance(opt, dict) else ""
    elastic = config.scaling.min_workers < config.scaling.max_workers
    if opt_type.lower() in UNRESHARDABLE_OPTIMIZERS and elastic:
        problems.append(
            f"{key}: optimizer type {opt_type!r} keeps state that depends on the world size "
            f"({UNRESHARDABLE_OPTIMIZERS[opt_type.lower()]}), so its checkpoints cannot be resharded; "
            "use Adam, AdamW, Lion, SGD or Adagrad, or fix the world size (scaling.min_workers == "
            "scaling.max_workers)"
        )
    tp_size = user_json_tensor_parallel(user)
    if tp_size != "auto" and tp_size != config.scaling.tensor_parallel:
        problems.append(
            f"{key}: tensor_parallel.autotp_size is {tp_size!r} in {path.name} but scaling.tensor_parallel "
            f"is {config.scaling.tensor_parallel}; set one of them to the other's value (or leave "
            "scaling.tensor_parallel at 1, and the JSON's value is used)"
        )
    zero = user.get("zero_optimization") if isinstance(user.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        problems.append(f"{key}: zero_optimization.stage is {stage!r} in {path.name}; expected 0, 1, 2 or 3")
    else:
        precision = "fp16" if _enabled(user, "fp16", t.precision == "fp16") else t.precision
        found = stage_problems(stage, *_offload_devices(zero), precision)
        problems.extend(f"{key}: in {path.name}: {text}" for text in found)
    unresolved: list[str] = []
    without_scheduler = {k: v for k, v in user.items() if k != "scheduler"}  # dropped: see module docstring
    _resolve_auto(without_scheduler, _auto_values(config, 1, 1), "", unresolved)
    problems.extend(
        f'{key}: "auto" at {p} in {path.name} cannot be resolved; give a value' for p in unresolved
    )
    return problems


OWNED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "scheduler",
)


def owned_settings_notice(config: Config) -> str | None:
    """One line naming what of the user's JSON elastictrain sets itself (checked: "auto" or agreeing)."""
    if not config.deepspeed.config_file:
        return None
    user = _read_user_json(config)
    owned = [k for k in OWNED_KEYS if k in user]
    if not owned:
        return None
    return (
        f"deepspeed.config_file: {', '.join(owned)} set by elastictrain (batch sizes at every world size "
        "from training.*; the LR schedule is training.lr_schedule)"
    )


def effective_offload(config: Config) -> tuple[str, str]:
    """(optimizer, parameter) offload devices that will actually be used."""
    if config.deepspeed.config_file:
        zero = _read_user_json(config).get("zero_optimization")
        return _offload_devices(zero if isinstance(zero, dict) else {})
    return config.deepspeed.offload_optimizer, config.deepspeed.offload_param


def build_deepspeed_config(
    config: Config,
    micro_batch_size: int,
    grad_accum_steps: int,
    replicas: int,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> dict:
    """The DeepSpeed config of one attempt: `replicas` data-parallel replicas of `tensor_parallel` ranks
    (or of `pipeline_parallel` stages)."""
    t = config.training
    assert micro_batch_size * grad_accum_steps * replicas == t.global_batch_size, "batch split must be exact"
    if config.deepspeed.config_file:
        cfg = _read_user_json(config)
        cfg.pop("scheduler", None)  # the LR schedule is training.lr_schedule's
        if "optimizer" not in cfg:
            # Hugging Face style: the Trainer would build AdamW from its arguments; so do we.
            zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
            cfg["optimizer"] = _adamw(config, offloaded=_offload_devices(zero)[0] != "none")
    else:
        cfg = _generated(config)
        cfg["optimizer"] = _adamw(config, offloaded=config.deepspeed.offload_optimizer != "none")
        if t.grad_clip > 0:
            cfg["gradient_clipping"] = t.grad_clip
    cfg = _resolve_auto(cfg, _auto_values(config, micro_batch_size, grad_accum_steps), "", [])
    # DeepSpeed checks train_batch_size against every rank of the world: with AutoTP the config is read
    # before its tensor-parallel groups exist, so each rank of a replica counts as one more replica.
    cfg["train_batch_size"] = t.global_batch_size * tensor_parallel
    if pipeline_parallel > 1:
        # Read once without the stages' groups (the model's build) and once with them (the pipeline
        # engine): DeepSpeed derives it from the micro-batch and accumulation at either world.
        del cfg["train_batch_size"]
    if tensor_parallel > 1 or isinstance(cfg.get("tensor_parallel"), dict):
        block = dict(cfg.get("tensor_parallel") or {})
        block.pop("tp_size", None)
        block["autotp_size"] = tensor_parallel  # the attempt's, also where the run (`--local`) has 1
        cfg["tensor_parallel"] = block
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = grad_accum_steps
    cfg.setdefault("steps_per_print", 10**9)  # elastictrain reports progress itself
    cfg.setdefault("wall_clock_breakdown", False)
    return _deep_merge(cfg, dict(config.deepspeed.extra))


def nvme_paths(ds_config: dict[str, Any]) -> list[str]:
    """The NVMe swap folders a DeepSpeed config names (optimizer state, parameters)."""
    zero = ds_config.get("zero_optimization", {})
    blocks = (zero.get("offload_optimizer") or {}, zero.get("offload_param") or {})
    return sorted({str(b["nvme_path"]) for b in blocks if b.get("device") == "nvme" and b.get("nvme_path")})


def for_rank(ds_config: dict[str, Any], run_id: str, rank: int) -> dict[str, Any]:
    """A rank's DeepSpeed config: NVMe swap under `<nvme_path>/<run_id>/rank-N`, so two runs (or two
    ranks on one node) sharing an nvme_path never write into one another's swap files."""
    if not nvme_paths(ds_config):
        return ds_config
    out = copy.deepcopy(ds_config)
    zero = out["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        if block and block.get("device") == "nvme" and block.get("nvme_path"):
            block["nvme_path"] = str(Path(block["nvme_path"]) / run_id / f"rank-{rank}")
    return out
