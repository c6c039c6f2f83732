"""Make the two local folders the transformers examples start from: a tokenizer and a small base model.

Nothing is downloaded. The tokenizer is a word-level one trained on the example's own JSONL text
(`tokenizers`, wrapped in PreTrainedTokenizerFast); the "pretrained" base is a tiny Llama with random
weights, saved with save_pretrained. With a real model you would skip this and point
`model.pretrained` and `data.tokenizer` at its folder.

    python examples/hf_causal_lm/prepare.py work/    # writes work/tokenizer and work/base-model
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "sentences.jsonl"


def build_tokenizer(texts: list[str], out_dir: Path) -> object:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_base_model(tokenizer: object, out_dir: Path, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)


def prepare(out: Path, data: Path = DATA) -> tuple[Path, Path]:
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    tokenizer = build_tokenizer(texts, out / "tokenizer")
    build_base_model(tokenizer, out / "base-model")
    return out / "tokenizer", out / "base-model"


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "work")
    tok_dir, model_dir = prepare(target)
    print(f"tokenizer: {tok_dir}\nbase model: {model_dir}")
