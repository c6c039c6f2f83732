"""A transformers decoder as DeepSpeed pipeline stages (`scaling.pipeline_parallel`).

The embedding, each decoder layer, and the final norm with the head become the layers of a DeepSpeed
`PipelineModule`, split into contiguous stages balanced by parameter counts (DeepSpeed's own partition).
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


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal LM loss: each position predicts the next token; -100 is not a target."""
    shifted = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
    return nn.functional.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=-100)


def stage_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers in order, as pipeline layers: embedding, each decoder layer, norm and head."""
    check_supported(model)
    inner = model.model  # type: ignore[attr-defined]
    if model.config.tie_word_embeddings:  # type: ignore[attr-defined]
        raise PipelineRefused(
            "scaling.pipeline_parallel: tied input and output embeddings are not split into stages yet; "
            "expected model.hf_config.tie_word_embeddings: false"
        )
    return [
        Embed(inner.embed_tokens),
        *(Decoder(layer, inner.rotary_emb) for layer in inner.layers),
        Head(inner.norm, model.lm_head),  # type: ignore[attr-defined]
    ]


def hf_name(layer_index: int, layers: int, name: str) -> str:
    """The transformers name of parameter `name` of pipeline layer `layer_index` of `layers`."""
    if layer_index == 0:
        return f"model.{name}"  # embed_tokens.weight
    if layer_index == layers - 1:
        return f"model.{name}" if name.startswith("norm.") else name  # lm_head.weight
    return f"model.layers.{layer_index - 1}.{name.removeprefix('layer.')}"


def topology(stages: int, replicas: int) -> Any:
    """Ranks replica by replica (`data` the outer axis): a replica's stages are consecutive ranks."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    return ProcessTopology(axes=["data", "pipe"], dims=[replicas, stages])


def pipeline_module(
    model: nn.Module,
    stages: int,
    replicas: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss,
) -> Any:
    """The model as a DeepSpeed PipelineModule of `stages` stages balanced by parameters (torch.distributed
    initialised, `stages` x `replicas` ranks)."""
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(
        layers=stage_layers(model),
        num_stages=stages,
        topology=topology(stages, replicas),
        loss_fn=loss_fn,
        partition_method="parameters",
    )
    # DeepSpeed's gradient norm (clipping, ZeRO's overflow check) counts a parameter on the model group's
    # first rank only, unless it is marked model-parallel (Megatron's convention for sliced weights): a
    # stage's weights are its own, so every stage counts its own and the norm is the whole model's.
    for param in module.parameters():
        param.model_parallel = True
    return module
