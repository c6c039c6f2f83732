"""A transformers decoder as DeepSpeed pipeline stages (`scaling.pipeline_parallel`).

The embedding, each decoder layer, and the final norm with the head become the layers of a DeepSpeed
`PipelineModule`, split into contiguous stages balanced by parameter counts (DeepSpeed's own partition).
Tied input and output embeddings (`tie_word_embeddings`) are one DeepSpeed tied layer held by the first
and the last stage: DeepSpeed sums its two gradients across them and counts it once in the norm.
Stages pass the hidden states only: each decoder layer computes its rotary position embeddings itself
(a parameter-free module of the model's config) and attends causally (no padding mask: sequences are
packed or of one length, as elastictrain's causal LM data is). Parameters keep their transformers names
(`hf_name`), so a checkpoint, an export and a run at another layout read them alike.

Ranks are laid out replica by replica: the P stages of replica d are ranks d*P .. d*P + P - 1, so a
replica's ranks are consecutive as a tensor-parallel replica's are, and the data order, the sample ledger
and losing a replica work the same (core/batch.py's ranks of a replica).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class PipelineRefused(ValueError):
    pass


def check_supported(model: nn.Module) -> None:
    name = type(model).__name__
    if name not in SUPPORTED:
        raise PipelineRefused(
            f"scaling.pipeline_parallel: {name} is not split into pipeline stages; expected one of "
            f"{', '.join(SUPPORTED)} (a standard decoder stack), or scaling.pipeline_parallel: 1"
        )


class Embed(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class Decoder(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # buffers only: every stage holds its own

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary(hidden, positions)
        out = self.layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class Norm(nn.Module):
    """The final norm alone: with tied embeddings the head is the embedding's tied layer."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class _Given(nn.Module):
    """A LayerSpec type whose build is a module that exists already (DeepSpeed ties layers given as specs)."""

    def __new__(cls, module: nn.Module) -> nn.Module:  # type: ignore[misc]
        return module


def tied_logits(embed: Embed, hidden: torch.Tensor) -> torch.Tensor:
    """The output head of a model whose head is its input embedding (tie_word_embeddings)."""
    return nn.functional.linear(hidden, embed.embed_tokens.weight)


TIED = "embed"  # DeepSpeed's key of the tied embedding layer
TIED_WEIGHT = "embed_tokens.weight"


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal LM loss: each position predicts the next token; -100 is not a target."""
    shifted = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
    return nn.functional.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=-100)


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model itself: `model`, or the one a LoRA (peft) model wraps, adapters in place."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    assert isinstance(base, nn.Module)
    return base


# Where a LoRA run's parameters sit under peft's wrapper: its checkpoints name them so at every layout.
LORA_PREFIX = "base_model.model."


def stage_layers(model: nn.Module) -> list[Any]:
    """The model's layers in order, as pipeline layers: embedding, each decoder layer, norm and head. With
    tied embeddings that train, the first and the last are DeepSpeed tied layer specs of the one
    embedding, the norm a layer of its own (`layer_module` gives each as a module); a frozen one (LoRA's
    base) needs no gradients summed, so the last stage holds its own copy as the head's weight."""
    model = transformers_model(model)
    check_supported(model)
    inner = model.model  # type: ignore[attr-defined]
    decoders = [Decoder(layer, inner.rotary_emb) for layer in inner.layers]
    trains = inner.embed_tokens.weight.requires_grad
    if not (model.config.tie_word_embeddings and trains):  # type: ignore[attr-defined]
        return [Embed(inner.embed_tokens), *decoders, Head(inner.norm, model.lm_head)]  # type: ignore[attr-defined]
    from deepspeed.pipe import TiedLayerSpec

    embed = Embed(inner.embed_tokens)
    return [
        TiedLayerSpec(TIED, _Given, embed, tied_weight_attr=TIED_WEIGHT),
        *decoders,
        Norm(inner.norm),
        TiedLayerSpec(TIED, _Given, embed, forward_fn=tied_logits, tied_weight_attr=TIED_WEIGHT),
    ]


def layer_module(layer: Any) -> nn.Module:
    """A pipeline layer as a module: itself, or the module a tied layer spec builds."""
    return layer if isinstance(layer, nn.Module) else layer.module_args[0]


def hf_name(layer_index: int, name: str) -> str:
    """The transformers name of parameter `name` of pipeline layer `layer_index` (the embedding is 0)."""
    if name.startswith("layer."):
        return f"model.layers.{layer_index - 1}.{name.removeprefix('layer.')}"
    if name.startswith("lm_head."):
        return name
    return f"model.{name}"  # embed_tokens.weight, norm.weight


def module_hf_name(name: str) -> str:
    """The transformers name of a PipelineModule parameter: `<layer>.<name>`, or the tied embedding's."""
    head, rest = name.split(".", 1)
    if head == "tied_modules":
        return f"model.{rest.split('.', 1)[1]}"  # tied_modules.embed.embed_tokens.weight
    return hf_name(int(head), rest)


def topology(stages: int, replicas: int) -> Any:
    """Ranks replica by replica (`data` the outer axis): a replica's stages are consecutive ranks."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    return ProcessTopology(axes=["data", "pipe"], dims=[replicas, stages])


class TokenLoss:
    """The last stage's loss of a micro-batch: its summed token losses times the step's scale (sent with
    the labels: 1 / the global batch's target tokens, times what DeepSpeed divides by), as the
    unpipelined step computes it (model/loss.py); the sums are kept for the step's report."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        from elastictrain.model.loss import token_loss_sum

        targets, scale = labels
        summed = token_loss_sum(logits, targets)
        self.sums.append(summed.detach().double())
        return summed * scale.to(summed.device)


def pipeline_module(
    layers: list[Any],
    stages: int,
    replicas: int,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] = next_token_loss,
    name_prefix: str = "",
) -> Any:
    """A model's `stage_layers` as a DeepSpeed PipelineModule of `stages` stages balanced by parameters
    (torch.distributed initialised, `stages` x `replicas` ranks): this rank keeps its stage's. Micro-batches
    may differ in length (padded records): each carries its shape to the next stage."""
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(
        layers=layers,
        num_stages=stages,
        topology=topology(stages, replicas),
        loss_fn=loss_fn,
        partition_method="parameters",
        dynamic_shape=True,
    )
    # Checkpoints, snapshots and exports name parameters as transformers does (checkpoint/tensor_slices.py).
    module.transformers_names = {
        name: name_prefix + module_hf_name(name) for name, _ in module.named_parameters()
    }
    # DeepSpeed's gradient norm (clipping, ZeRO's overflow check) counts a parameter on the model group's
    # first rank only, unless it is marked model-parallel (Megatron's convention for sliced weights): a
    # stage's weights are its own, so every stage counts its own and the norm is the whole model's. The
    # tied embedding's copy on the last stage (DeepSpeed marks it ds_pipe_replicated) is the first
    # stage's: ZeRO's norm skips it, and so must ZeRO-0's clipping, which reads only this mark.
    for param in module.parameters():
        param.model_parallel = not getattr(param, "ds_pipe_replicated", False)
    return module


def new_pipeline_engine(spec: Any, model: nn.Module) -> Any:
    """The attempt's DeepSpeed pipeline engine around `model`: built whole (a fresh random init, the same
    on every rank), or on the meta device (weights from a pretrained folder, a checkpoint or snapshots),
    where only this rank's stage is made real. The loss is TokenLoss; a non-finite step is skipped by
    every stage."""
    import deepspeed

    from elastictrain.checkpoint.model_record import built_model
    from elastictrain.compat.deepspeed.skip_update import skip_non_finite_updates

    stages, replicas = spec.plan.pipeline_parallel, spec.plan.data_parallel
    cfg = spec.config
    layers = stage_layers(model)
    parts = None
    if next(model.parameters()).is_meta:
        adapters_seed = cfg.training.seed if cfg.model.lora.enabled else None
        parts = make_this_stage_real(
            transformers_model(model), layers, stages, replicas, cfg.model.pretrained, adapters_seed
        )
    prefix = LORA_PREFIX if cfg.model.lora.enabled else ""
    module = pipeline_module(layers, stages, replicas, TokenLoss(), prefix)
    if not any(p.requires_grad for p in module.parameters()):
        # DeepSpeed's backward would fail on this stage's outputs, which need no gradient.
        raise PipelineRefused(
            f"scaling.pipeline_parallel: {stages} stages leave stage {module.stage_id} (layers "
            f"{module.parts[module.stage_id]}..{module.parts[module.stage_id + 1] - 1}) nothing to train: "
            "expected fewer stages, or LoRA target_modules in every decoder layer"
        )
    module.hf_record = built_model(model)  # the export's config: the stages alone are no transformers model
    if parts is not None and list(module.parts) != parts:
        raise RuntimeError(f"pipeline stages: DeepSpeed split the layers at {module.parts}, not {parts}")
    engine, *_ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=spec.ds_config,
    )
    skip_non_finite_updates(engine, across_ranks=True)
    return engine


def make_this_stage_real(
    model: nn.Module,
    layers: list[Any],
    stages: int,
    replicas: int,
    pretrained: str | None,
    adapters_seed: int | None,
) -> list[int]:
    """`model` built on the meta device (no memory), `layers` its `stage_layers`: this rank's stage's
    layers get memory, their rotary tables computed, their LoRA adapters their first values
    (`adapters_seed`; None: no LoRA), and (`pretrained`) their weights read from the folder, nothing
    else; the other layers stay meta and are dropped when the PipelineModule keeps this stage. Returns
    the split, found as DeepSpeed's "parameters" partition finds it (the caller checks DeepSpeed's)."""
    import torch.distributed as dist
    from deepspeed.runtime.utils import partition_balanced

    modules = [layer_module(layer) for layer in layers]
    # As DeepSpeed counts: a tied layer's parameters at each place it appears.
    counts = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in modules]
    parts = list(partition_balanced(weights=counts, num_parts=stages))
    stage = topology(stages, replicas).get_coord(dist.get_rank()).pipe
    mine = range(parts[stage], parts[stage + 1])
    # Rotary tables are computed, not stored: the stage's decoders share a real one; its other modules get
    # memory, uninitialised (the load or the pretrained read fills them).
    rotary = type(model.model.rotary_emb)(config=model.config)  # type: ignore[operator, union-attr]
    for i in mine:
        for name, child in modules[i].named_children():
            if name != "rotary":
                child.to_empty(device="cpu")
        if isinstance(modules[i], Decoder):
            modules[i].rotary = rotary
    if adapters_seed is not None:
        from elastictrain.model.lora import init_adapters

        mine_named = ((hf_name(i, n), m) for i in mine for n, m in modules[i].named_modules() if n)
        init_adapters(mine_named, adapters_seed)
    if pretrained:
        tied = bool(model.config.tie_word_embeddings)  # type: ignore[union-attr]
        names = {
            _pretrained_name(hf_name(i, name), tied): param
            for i in mine
            for name, param in modules[i].named_parameters()
            if not _is_adapter(name)
        }
        _read_pretrained(pretrained, names)
    return parts


def _is_adapter(name: str) -> bool:
    """A LoRA adapter's parameter (peft's lora_A, lora_B, ...): not in a pretrained folder."""
    return ".lora_" in name


def _pretrained_name(name: str, tied: bool) -> str:
    """Where a stage's parameter lies in a pretrained folder: LoRA's wrapped layers under their own names; a
    frozen head tied to the embedding (LoRA's base) is the embedding."""
    name = name.replace(".base_layer.", ".")
    return "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name


def _read_pretrained(folder: str, params: dict[str, torch.Tensor]) -> None:
    """Fill `params` (by transformers name) from the folder's safetensors files, reading those alone."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    root = Path(folder)
    index = root / "model.safetensors.index.json"
    if not index.is_file() and not (root / "model.safetensors").is_file():
        raise PipelineRefused(
            f"model.pretrained: {folder} has no model.safetensors or model.safetensors.index.json (pipeline "
            "stages read safetensors weights)"
        )
    files = (
        json.loads(index.read_text())["weight_map"]
        if index.is_file()
        else dict.fromkeys(params, "model.safetensors")
    )
    missing = sorted(n for n in params if n not in files)
    if missing:
        raise PipelineRefused(f"model.pretrained: {folder} has no weights for {missing[:3]}")
    for file in sorted({files[n] for n in params}):
        with safe_open(str(root / file), "pt") as handle, torch.no_grad():
            for name in (n for n in params if files[n] == file):
                params[name].copy_(handle.get_tensor(name))


def train_pipeline_batch(engine: Any, batches: list[tuple[Any, int]], scale: torch.Tensor) -> torch.Tensor:
    """One step of `batches` (this replica's micro-batches) through the stages; the replica's summed token
    losses (fp64), on every stage: the last stage computes them and sends them to the others."""
    from elastictrain.model.loss import lm_labels

    loss: TokenLoss = engine.module.loss_fn
    loss.sums = []
    items = [(_input_ids(batch), (lm_labels(batch), scale)) for batch, _ in batches]
    if batches:
        torch.manual_seed(batches[0][1])  # what randomness there is follows the step's first position
    engine.train_batch(data_iter=iter(items))
    return _last_stage_sum(engine, loss)


def eval_pipeline_batch(engine: Any, batches: list[Any]) -> torch.Tensor:
    """The summed token losses (fp64) of this replica's micro-batches `batches` through the stages,
    forward only, on every stage: the last computes them and sends them to the others."""
    from elastictrain.model.loss import lm_labels

    loss: TokenLoss = engine.module.loss_fn
    loss.sums = []
    one = torch.ones((), dtype=torch.float32)
    items = [(_input_ids(batch), (lm_labels(batch), one)) for batch in batches]
    engine.eval_batch(data_iter=iter(items), bcast_loss=False, num_micro_batches=len(items))
    return _last_stage_sum(engine, loss)


def _last_stage_sum(engine: Any, loss: TokenLoss) -> torch.Tensor:
    """The replica's summed token losses (fp64) on every stage: the last stage's sums, sent to the others."""
    import torch.distributed as dist

    summed = torch.stack(loss.sums).sum() if loss.sums else torch.zeros((), dtype=torch.float64)
    summed = summed.reshape(1).to(engine.device)
    grid = engine.grid
    dist.broadcast(summed, src=grid.pp_group[-1], group=grid.get_pipe_parallel_group())
    return summed[0]


def _input_ids(batch: Any) -> torch.Tensor:
    """A micro-batch's token ids, refusing what the stages cannot pass on (packed records' positions, a
    mask that is not right padding: stages attend causally over every position before a token)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if "position_ids" in batch:
        raise PipelineRefused(
            "scaling.pipeline_parallel: packed records (position_ids) cannot pass through pipeline stages; "
            "set data.packing: false"
        )
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise PipelineRefused(
            "scaling.pipeline_parallel: a micro-batch is padded on the left; stages need padding on the right"
        )
    return batch["input_ids"]
