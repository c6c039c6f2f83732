"""The check `export` makes before it publishes a folder: what it wrote loads, and gives the logits of
the checkpoint's own model (tools/export_models.py) on a few sequences.

The export is loaded as transformers (or peft) loads it, in its dtype, then run in float32: the
comparison measures the files, not the CPU's bfloat16 kernels. Its tolerance is the dtype's, derived
rather than guessed: float32 noise (1e-5 of the logits' scale) plus twice what rounding the weights
to the export's dtype alone moves the reference's logits (0 for float32). A wrong file, name, config
or tie moves logits by their own scale, far beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SEQUENCES, TOKENS = 3, 16
FP32_NOISE = 1e-5  # relative to the logits' scale: summation order, nothing else differs


class ExportCheckFailed(ValueError):
    pass


@dataclass(frozen=True)
class Checked:
    """What the check measured: the largest |export - checkpoint| logit, and its tolerance."""

    difference: float
    tolerance: float
    rounding: float  # the largest logit move from rounding the weights to the dtype alone
    sequences: int
    tokens: int

    def line(self, dtype: str) -> str:
        return (
            f"check: logits of {self.sequences} sequences x {self.tokens} tokens: max |export - checkpoint| "
            f"{self.difference:.1e} (tolerance {self.tolerance:.1e} for {dtype}; rounding to {dtype} alone: "
            f"{self.rounding:.1e})"
        )


def sample_ids(vocab_size: int) -> torch.Tensor:
    """A few fixed sequences of token ids (the same for every export of a model)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (SEQUENCES, TOKENS), generator=generator)


@torch.no_grad()
def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


@torch.no_grad()
def round_parameters(model: torch.nn.Module, dtype: torch.dtype, only: set[str] | None = None) -> None:
    """Round `model`'s parameters (or those named in `only`) to `dtype`, kept in float32, in place."""
    for name, p in model.named_parameters():
        if only is None or name in only:
            p.data = p.data.to(dtype).float()


@dataclass(frozen=True)
class Reference:
    """The checkpoint's logits, and the same model's with its weights rounded to the export's dtype."""

    ids: torch.Tensor
    logits: torch.Tensor
    rounded: torch.Tensor


def compare(reference: Reference, candidate: torch.Tensor, dtype: torch.dtype) -> Checked:
    """Raise ExportCheckFailed naming the largest difference when it is beyond the dtype's tolerance."""
    ref = reference.logits
    scale = max(1.0, float(ref.abs().max()))
    rounding = float((reference.rounded - ref).abs().max())
    tolerance = FP32_NOISE * scale + 2 * rounding
    if candidate.shape != ref.shape:
        raise ExportCheckFailed(
            f"the export's logits have shape {tuple(candidate.shape)}, the checkpoint's {tuple(ref.shape)}"
        )
    diff = (candidate - ref).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if not worst <= tolerance:  # NaN fails too
        seq, pos, token = (
            (int(i) for i in torch.nonzero(diff == diff.max())[0]) if worst == worst else (0, 0, 0)
        )
        raise ExportCheckFailed(
            f"the exported model's logits differ from the checkpoint's by up to {worst:.3e} (sequence {seq}, "
            f"position {pos}, token {token}: export {float(candidate[seq, pos, token]):.6g}, checkpoint "
            f"{float(ref[seq, pos, token]):.6g}); the tolerance for {str(dtype).removeprefix('torch.')} is "
            f"{tolerance:.3e}"
        )
    return Checked(worst, tolerance, rounding, int(ref.shape[0]), int(ref.shape[1]))


def loaded_cleanly(info: dict[str, Any], folder: Any) -> None:
    """from_pretrained's loading info: every weight in the files was used, none left at its init."""
    problems = {k: info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    found = {k: sorted(map(str, v))[:5] for k, v in problems.items() if v}
    if found:
        raise ExportCheckFailed(f"transformers loads {folder} with problems: {found}")


def same_tokenizer(source: str, folder: Any) -> None:
    """The tokenizer saved in the export loads, with the source's vocabulary and chat template."""
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(source, local_files_only=True)
    saved = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    text = "Hello, world: 123 export check."
    if len(saved) != len(original) or saved(text)["input_ids"] != original(text)["input_ids"]:
        raise ExportCheckFailed(f"the tokenizer saved in {folder} does not tokenize as {source} does")
    if getattr(saved, "chat_template", None) != getattr(original, "chat_template", None):
        raise ExportCheckFailed(f"the tokenizer saved in {folder} lost the chat template of {source}")
