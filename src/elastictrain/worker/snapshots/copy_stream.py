"""Copies of the state to host memory beside the next step: on a GPU, on their own CUDA stream."""

from __future__ import annotations

from typing import Any


def copy_stream(engine: Any) -> Any:
    """On a GPU, a CUDA stream for the copy that starts after the kernels queued so far (this step's
    update): the copy then overlaps the next step's kernels instead of queueing behind them. None on CPU."""
    import torch

    if not torch.cuda.is_available() or getattr(engine, "device", None) is None:
        return None
    if torch.device(engine.device).type != "cuda":
        return None
    stream = torch.cuda.Stream(device=engine.device)
    stream.wait_stream(torch.cuda.current_stream(engine.device))
    return stream


def on_stream(stream: Any) -> Any:
    import contextlib

    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
