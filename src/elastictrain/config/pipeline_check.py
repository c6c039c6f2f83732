"""What `scaling.pipeline_parallel: P` needs of the config, said when it loads.

The world is world_size / P data-parallel replicas of P pipeline stages (model/pipeline.py splits a
transformers decoder into them). DeepSpeed's pipeline engine trains with ZeRO stage 0 or 1 and its own
schedule of micro-batches; what it cannot run, or what elastictrain does not run through it yet, is
refused here by name.
"""

from __future__ import annotations

from typing import Any

from elastictrain.config.tensor_parallel_check import whole_replica_problems

# transformers model types model/pipeline.py splits (a standard decoder stack: embedding, decoder layers
# computing their own rotary embeddings, final norm, head).
PIPELINE_MODEL_TYPES = ("llama", "qwen2", "mistral")


def fixed_stages(config: Any) -> int:
    """The stages world sizes are whole replicas of: scaling.pipeline_parallel, or 1 under auto (each
    attempt takes the stages chosen for its world size) and where the value is refused below."""
    p = config.scaling.pipeline_parallel
    return p if isinstance(p, int) and not isinstance(p, bool) and p >= 1 else 1


def pipeline_problems(config: Any) -> list[str]:
    s, ds, m = config.scaling, config.deepspeed, config.model
    n = s.pipeline_parallel
    if n == "auto":
        if s.tensor_parallel == "auto":
            # Each chooser would pick its axis alone, and a resize could pick both.
            return [
                "scaling.pipeline_parallel: got 'auto' with scaling.tensor_parallel: auto; a replica is "
                "either stages or tensor-parallel ranks (tensor parallelism inside stages is not supported "
                "yet): set one of them to a number (1: none)"
            ]
        return []  # the chooser offers stages only where this check passes (driver/pipeline_auto.py)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return [
            f"scaling.pipeline_parallel: got {n!r}; expected a whole number >= 1 (1: no pipeline) or auto"
        ]
    if n == 1:
        return []
    p = whole_replica_problems(s, "pipeline_parallel", n, "stages")
    tp = s.tensor_parallel
    if tp != 1:
        # DeepSpeed's AutoTP training builds its tensor- and data-parallel groups as one mesh over all
        # ranks, with no pipeline axis: its data-parallel group would mix stages.
        p.append(
            f"scaling.tensor_parallel: got {tp!r} with scaling.pipeline_parallel {n}; tensor parallelism "
            "inside pipeline stages is not supported yet: set one of them to 1"
        )
    if ds.zero_stage not in (0, 1):
        p.append(
            f"deepspeed.zero_stage: got {ds.zero_stage!r} with scaling.pipeline_parallel {n}; DeepSpeed's "
            "pipeline engine trains with stage 0 or 1 only"
        )
    if ds.config_file:
        p.append(
            "deepspeed.config_file: a DeepSpeed JSON of your own with scaling.pipeline_parallel is not "
            "supported yet; give the ZeRO stage and precision in the deepspeed section"
        )
    for key in ("offload_optimizer", "offload_param"):
        if getattr(ds, key) != "none":
            p.append(
                f"deepspeed.{key}: got {getattr(ds, key)!r} with scaling.pipeline_parallel {n}; offload "
                "with pipeline stages is not supported yet: expected none"
            )
    if ds.activation_checkpointing not in (False,):
        p.append(
            f"deepspeed.activation_checkpointing: got {ds.activation_checkpointing!r} with "
            f"scaling.pipeline_parallel {n}; not supported with pipeline stages yet: expected false"
        )
    hf: dict[str, Any] = {}
    if m.factory:
        p.append(
            f"model.factory: got {m.factory!r} with scaling.pipeline_parallel {n}; pipeline stages are "
            f"cut from transformers decoders ({', '.join(PIPELINE_MODEL_TYPES)}), not from a model of "
            "your own"
        )
    else:
        if m.pretrained:
            hf, where = _pretrained_config(m.pretrained), "model.pretrained's config.json: "
        else:
            hf, where = dict(m.hf_config), "model.hf_config."
        kind = hf.get("model_type")
        if hf and kind not in PIPELINE_MODEL_TYPES:
            p.append(
                f"{where}model_type: got {kind!r} with scaling.pipeline_parallel {n}; expected one "
                f"of {', '.join(PIPELINE_MODEL_TYPES)} (a standard decoder stack)"
            )
        layers = hf.get("num_hidden_layers")
        if isinstance(layers, int) and layers + 2 < n:
            p.append(
                f"scaling.pipeline_parallel: got {n}; the model has {layers} decoder layers, so at most "
                f"{layers + 2} stages (embedding, each layer, head)"
            )
    if m.lora.enabled:
        p += _lora_problems(m.lora, n, hf.get("num_hidden_layers"))
    if m.compile:
        p.append(f"model.compile: true with scaling.pipeline_parallel {n} is not supported yet")
    t = config.training
    if t.objective != "lm":
        p.append(
            f"training.objective: got {t.objective!r} with scaling.pipeline_parallel {n}; pipeline stages "
            "train the causal LM loss (lm) only"
        )
    if t.loss:
        p.append(
            f"training.loss: got {t.loss!r} with scaling.pipeline_parallel {n}; pipeline stages train the "
            "built-in causal LM loss only"
        )
    if config.data.source == "sft" and config.data.packing:
        p.append(
            "data.packing: true with data.source sft and scaling.pipeline_parallel; packed records keep "
            "apart by position ids the stages do not pass: expected false (records padded)"
        )
    return p


# Layers LoRA may wrap inside a stage's decoder layers; the embedding and the head are frozen whole.
_OUTSIDE_DECODERS = ("embed_tokens", "lm_head")


def _lora_problems(lora: Any, n: int, layers: Any) -> list[str]:
    p = []
    for key in ("use_dora", "modules_to_save"):
        if getattr(lora, key):
            p.append(
                f"model.lora.{key}: got {getattr(lora, key)!r} with scaling.pipeline_parallel {n}; not "
                "supported with pipeline stages yet: expected false or []"
            )
    targets = lora.target_modules
    outside = [t for t in _OUTSIDE_DECODERS if not isinstance(targets, str) and t in targets]
    if outside:
        p.append(
            f"model.lora.target_modules: {outside} with scaling.pipeline_parallel {n}; adapters live in the "
            "decoder layers of each stage: expected layers inside them (q_proj, v_proj, ...) or all-linear"
        )
    if isinstance(layers, int) and n > layers:
        p.append(
            f"scaling.pipeline_parallel: got {n} with LoRA; a stage needs a decoder layer's adapters to "
            f"train and the model has {layers}: expected at most {layers} stages"
        )
    return p


def _pretrained_config(folder: str) -> dict[str, Any]:
    """The pretrained folder's config.json ({} where it cannot be read: the model's own check says why)."""
    import json
    from pathlib import Path

    try:
        found = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
