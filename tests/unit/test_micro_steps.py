"""One optimizer step's micro-batches: one read of the device per step, and the snapshot wait only
before the update that changes weights (the accumulation boundary)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastictrain.model.build import causal_lm_loss
from elastictrain.model.loss import causal_lm_loss_sum
from elastictrain.worker.micro_steps import run_micro_batches

VOCAB = 11


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.embed(input_ids))}


class RecordingEngine:
    """What run_micro_batches needs of a DeepSpeed engine, recording the order of its calls."""

    device = torch.device("cpu")

    def __init__(self, calls: list[str]) -> None:
        self.module = TinyLM()
        self.calls = calls

    def __call__(self, **kwargs: Any) -> dict[str, torch.Tensor]:
        self.calls.append("forward")
        return self.module(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append("backward")
        loss.backward()

    def step(self) -> None:
        self.calls.append("step")


def _batches(n: int) -> list[tuple[dict[str, torch.Tensor], int]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        labels = ids.clone()
        labels[:, : i + 1] = -100  # a different number of trained tokens in each micro-batch
        out.append(({"input_ids": ids, "labels": labels}, 100 + i))
    return out


def _own_loss(engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = engine(**batch)["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["input_ids"].reshape(-1))


@pytest.mark.parametrize("loss_fn", [causal_lm_loss, _own_loss], ids=["built-in loss", "own loss"])
def test_the_snapshot_wait_comes_only_before_the_last_micro_batch_update(loss_fn):
    calls: list[str] = []
    engine = RecordingEngine(calls)
    run_micro_batches(engine, loss_fn, _batches(4), world_size=1, before_update=lambda: calls.append("wait"))
    assert calls.count("wait") == 1
    assert calls[-2:] == ["wait", "step"], calls
    assert calls.count("step") == 4


@pytest.mark.parametrize("loss_fn", [causal_lm_loss, _own_loss], ids=["built-in loss", "own loss"])
def test_a_step_of_four_micro_batches_reads_the_device_once(loss_fn, monkeypatch):
    reads: list[str] = []
    for name in ("item", "tolist", "__int__", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original, **k: Any) -> Any:
            reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run_micro_batches(RecordingEngine([]), loss_fn, _batches(4), world_size=1)
    assert len(reads) == 1, f"device reads in one step: {reads}"


def test_the_reported_loss_is_the_sum_over_micro_batches_read_as_floats_would_sum():
    batches = _batches(3)
    result = run_micro_batches(RecordingEngine([]), causal_lm_loss, batches, world_size=1)
    model = TinyLM()
    expected_sum, expected_tokens = 0.0, 0
    for batch, _ in batches:
        summed, count = causal_lm_loss_sum(model, batch)
        expected_sum += float(summed.item())
        expected_tokens += count
    assert result.target_tokens == expected_tokens
    assert result.loss_sum == expected_sum  # the same fp64 additions in the same order: equal, not close
    assert result.loss == expected_sum / expected_tokens


class _Wrapper:
    """As DeepSpeed's ZeRO and bf16 optimizers hold the torch optimizer they step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def test_a_pipeline_step_waits_for_the_snapshot_copy_as_the_update_starts_not_before_the_passes():
    """DeepSpeed's pipeline schedule makes the update inside train_batch: the wait for a snapshot copy
    is hooked to the torch optimizer inside the engine's, so the copy runs beside the passes; once per
    step, and on leaving where no update was made (a skipped step), not after an error."""
    from elastictrain.worker.micro_steps import _called_before_the_update

    weight = torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.Adam([weight], lr=0.1)
    engine = type("Engine", (), {"optimizer": _Wrapper(_Wrapper(adam))})()
    seen: list[str] = []

    def before_update() -> None:
        seen.append(f"copy ends, weight {weight.tolist()}")

    with _called_before_the_update(engine, before_update):
        seen.append("passes")
        weight.grad = torch.ones(2)
        adam.step()
        adam.step()  # ZeRO steps its torch optimizer once per parameter group
    assert seen == ["passes", "copy ends, weight [1.0, 1.0]"]

    seen.clear()
    with _called_before_the_update(engine, before_update):
        seen.append("passes, the update skipped")
    assert seen == ["passes, the update skipped", f"copy ends, weight {weight.tolist()}"]

    seen.clear()
    with pytest.raises(RuntimeError), _called_before_the_update(engine, before_update):
        raise RuntimeError("a peer is gone")
    adam.step()  # the hook went with the failed step
    assert seen == []
