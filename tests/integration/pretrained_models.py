"""Tiny pretrained model folders made in the test (no downloads), for tests of `model.pretrained` runs.

    from pretrained_models import make_pretrained          # tests/integration/
    from integration.pretrained_models import make_pretrained   # tests/unit/

    folder = make_pretrained(tmp_path / "qwen", "qwen2")   # or "llama"

Each folder is what `save_pretrained` writes for a real model and its tokenizer: config.json,
model.safetensors, generation_config.json, tokenizer.json + tokenizer_config.json and the chat
template (chat_template.jinja). The models are random (a fixed seed per kind: the same weights every
call), about 40k parameters:

- "qwen2": Qwen2ForCausalLM, tied embeddings, grouped-query attention (4 heads, 2 key/value heads);
- "llama": LlamaForCausalLM, untied embeddings and LM head, 4 heads and 4 key/value heads.

Both have VOCAB (320) embedding rows, more than the byte ids of the built-in generated data (< 256)
and than their tokenizer's tokens: a BPE tokenizer trained here with the `tokenizers` library on a
small English text (byte-level, so it encodes any text), wrapped as a PreTrainedTokenizerFast.
Stable for other tests: add a kind rather than change one.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 320
HIDDEN = 32
KINDS = ("qwen2", "llama")

_TEXT = (
    "the quick brown fox jumps over the lazy dog. a user asks and the assistant answers. "
    "training a small model on a few sentences is enough to test how it is saved and loaded. "
)

_SPECIAL = {
    "qwen2": {"pad": "<|endoftext|>", "bos": None, "eos": "<|im_end|>", "extra": ["<|im_start|>"]},
    "llama": {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "extra": []},
}

_CHAT_TEMPLATE = {
    "qwen2": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama": (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
    ),
}


def make_tokenizer(kind: str):  # noqa: ANN201 - transformers.PreTrainedTokenizerFast
    """A byte-level BPE tokenizer of at most 300 tokens with the kind's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = _SPECIAL[kind]
    names = [t for t in (special["pad"], special["bos"], special["eos"], *special["extra"]) if t]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=names, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([_TEXT] * 20, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=special["pad"],
        bos_token=special["bos"],
        eos_token=special["eos"],
    )
    wrapped.chat_template = _CHAT_TEMPLATE[kind]
    return wrapped


def make_pretrained(folder: Path, kind: str) -> Path:
    """Write a tiny pretrained model of `kind` ("qwen2" | "llama") with its tokenizer into `folder`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if kind not in KINDS:
        raise ValueError(f"kind: got {kind!r}; expected one of {', '.join(KINDS)}")
    tokenizer = make_tokenizer(kind)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
    }
    torch.manual_seed(1 if kind == "qwen2" else 2)
    if kind == "qwen2":
        config = Qwen2Config(**shape, **ids, num_key_value_heads=2, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config)
    else:
        config = LlamaConfig(**shape, **ids, num_key_value_heads=4, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        **ids, max_new_tokens=32, do_sample=True, temperature=0.7, top_p=0.9
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
