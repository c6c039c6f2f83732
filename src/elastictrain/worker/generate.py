"""What the model says at a validation: greedy completions of `eval.prompts` (docs/validation.md).

Under ZeRO-3 each forward gathers the partitioned parameters with collectives, so every rank generates
every prompt in the same order and for the same number of forwards: transformers' `synced_gpus` keeps
a rank whose text has ended calling the model until every rank's has. All ranks then hold the same
text; the controller logs rank 0's. One prompt at a time: no padding, so a completion does not depend
on the prompts beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.core.prompts import BYTES, keep_last, prompt_count, prompt_tokenizer, split_record


class ByteCodec:
    """The built-in byte tokenizer of generated and file data (data/sources.py): token i is byte i."""

    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        # A model with more than 256 rows may emit ids that are no byte: dropped.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class TokenizerCodec:
    """A transformers tokenizer; string prompts go through its chat template where it has one."""

    def __init__(self, tokenizer: Any, *, chat: bool, special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.special_tokens = special_tokens
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id

    def encode(self, text: str) -> list[int]:
        if self.chat:
            messages = [{"role": "user", "content": text}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        # As the training data was encoded: packed text without special tokens, padded records with them.
        return list(self.tokenizer(text, add_special_tokens=self.special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))


@dataclass(frozen=True)
class Prompt:
    text: str  # as logged: the string given, or a record's prompt part decoded
    ids: list[int]
    reference: str = ""  # what follows a record's prompt part in the validation set


@dataclass(frozen=True)
class PromptSet:
    codec: ByteCodec | TokenizerCodec
    prompts: list[Prompt]


def prompt_set(config: Any, eval_dataset: Any) -> PromptSet | None:
    """The run's prompts encoded once (on every rank alike), or None without eval.prompts."""
    e = config.eval
    if e.prompts is None:
        return None
    data = e.data or config.data
    source = prompt_tokenizer(data, config.model.pretrained)
    if source is None:  # the config check refuses it; kept for configs built by hand
        raise ValueError("eval.prompts: no tokenizer; set data.tokenizer or use model.pretrained")
    codec: ByteCodec | TokenizerCodec
    if source == BYTES:
        codec = ByteCodec()
    else:
        from elastictrain.data.hf_files import load_tokenizer

        codec = TokenizerCodec(load_tokenizer(source), chat=e.chat_template, special_tokens=not data.packing)
    if isinstance(e.prompts, int):
        return PromptSet(codec, _from_records(eval_dataset, int(e.prompts), codec))
    return PromptSet(codec, [Prompt(str(text), codec.encode(str(text))) for text in e.prompts])


def _from_records(dataset: Any, asked: int, codec: ByteCodec | TokenizerCodec) -> list[Prompt]:
    if dataset is None:
        raise ValueError(f"eval.prompts: got {asked}; the run has no validation set to take prompts from")
    out = []
    for i in range(prompt_count(asked, len(dataset))):
        ids, labels, mask = _record_tokens(dataset[i], asked)
        prompt, reference = split_record(ids, labels, mask)
        out.append(Prompt(codec.decode(prompt, skip_special=False), prompt, codec.decode(reference)))
    return out


def _record_tokens(item: Any, asked: int) -> tuple[list[int], list[int] | None, list[int] | None]:
    def listed(value: Any) -> list[int] | None:
        return None if value is None else [int(t) for t in torch.as_tensor(value).reshape(-1).tolist()]

    if isinstance(item, Mapping) and "input_ids" in item:
        ids = listed(item["input_ids"])
        assert ids is not None
        labels, mask = listed(item.get("labels")), listed(item.get("attention_mask"))
        positions = listed(item.get("position_ids"))
        if positions is not None:  # a packed bin (data/sft/packing.py): its first record only
            end = next((i for i in range(1, len(positions)) if positions[i] == 0), len(positions))
            ids, labels, mask = ids[:end], labels and labels[:end], mask and mask[:end]
        return ids, labels, mask
    if isinstance(item, torch.Tensor) and not item.is_floating_point():
        return [int(t) for t in item.reshape(-1).tolist()], None, None
    raise ValueError(
        f"eval.prompts: got {asked}; a validation record is a {type(item).__name__}, not token ids (a "
        "tensor, or a mapping with input_ids) to take a prompt from; give eval.prompts as a list of strings"
    )


def complete(engine: Any, prompts: PromptSet, max_new_tokens: int, *, synced: bool) -> list[dict[str, str]]:
    """Greedy completions of every prompt: [{prompt, completion, reference}], the same on every rank.

    `synced`: every rank takes part (ZeRO-3 at world size > 1), so none may stop calling the model
    before the others.
    """
    from transformers import GenerationConfig

    module = engine.module
    if hasattr(module, "transformers_names"):  # pipeline stages: the replica generates stage by stage
        return _complete_through_stages(engine, prompts, max_new_tokens)
    if not hasattr(module, "generate"):
        raise ValueError(
            f"eval.prompts: the model ({type(module).__name__}) has no generate(); completions need a "
            "transformers causal LM"
        )
    codec = prompts.codec
    tokens: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1}
    # Plain greedy: the neutral values, else a model's generation_config.json (a served model's sampling
    # settings) would fill them in, and transformers warns that greedy ignores them.
    tokens.update(temperature=1.0, top_p=1.0, top_k=50, repetition_penalty=1.0)
    if codec.eos_token_id is not None:  # else the model's own generation config says when text ends
        tokens["eos_token_id"] = codec.eos_token_id
    pad = codec.pad_token_id if codec.pad_token_id is not None else codec.eos_token_id
    tokens["pad_token_id"] = pad if pad is not None else 0
    generation = GenerationConfig(**tokens)
    positions = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    was_training = module.training
    module.eval()
    out = []
    try:
        with torch.no_grad():
            for p in prompts.prompts:
                ids = torch.tensor([keep_last(p.ids, positions, max_new_tokens)], device=engine.device)
                generated = module.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=generation,
                    synced_gpus=synced,
                )
                new = generated[0, ids.shape[1] :].tolist()
                out.append({"prompt": p.text, "completion": codec.decode(new), "reference": p.reference})
    finally:
        module.train(was_training)
    return out


def _complete_through_stages(engine: Any, prompts: PromptSet, max_new_tokens: int) -> list[dict[str, str]]:
    """`complete` for a pipeline replica (model/pipeline_generate.py): greedy as generate() is, ending
    where it ends (the codec's end of text, else the model's generation config's)."""
    from elastictrain.model.pipeline_generate import greedy_through_stages

    codec = prompts.codec
    record = engine.module.hf_record
    config, generation = record["config"], record.get("generation_config") or {}
    eos = codec.eos_token_id
    if eos is None:
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
    ends = set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    out = []
    for p in prompts.prompts:
        ids = keep_last(p.ids, config.get("max_position_embeddings"), max_new_tokens)
        new = greedy_through_stages(engine, ids, max_new_tokens, ends)
        out.append({"prompt": p.text, "completion": codec.decode(new), "reference": p.reference})
    return out
