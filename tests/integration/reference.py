"""The plain PyTorch reference loop lives in benchmarks/reference.py (the GPU check runs it too)."""

from benchmarks.reference import causal_lm_loss, global_batch, reference_model, train_reference

__all__ = ["causal_lm_loss", "global_batch", "reference_model", "train_reference"]
