"""A rank's checkpoint file as planned by checkpoint/rank_snapshot.py: a valid safetensors file whose
fragments read back exactly, written in few large runs; a short or failing stream leaves no file."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from elastictrain.checkpoint.rank_snapshot import plan_rank_file
from elastictrain.checkpoint.writer import ShardWrite
from elastictrain.checkpoint.zero_layouts import LocalSlice
from elastictrain.storage.durable import sha256_of_file


def _group(names_lengths: list[tuple[str, int]], gap: int = 0) -> list[LocalSlice]:
    out, offset = [], 0
    for name, length in names_lengths:
        out.append(LocalSlice(name, 0, length, length, (length,), offset))
        offset += length + gap
    return out


def test_contiguous_pieces_of_a_group_are_one_run_per_field() -> None:
    plan = plan_rank_file([_group([("a", 5), ("b", 7)]), _group([("c", 3)])], ["fp32", "exp_avg"])
    assert [(r.field, r.source_offset, r.file_offset, r.length) for r in plan.runs[0]] == [
        ("fp32", 0, 0, 12),
        ("exp_avg", 0, 12, 12),
    ]
    assert plan.numel == 2 * (12 + 3)
    assert plan.keys["c::exp_avg"] == (27, 3)


def test_pieces_with_padding_between_them_are_separate_runs() -> None:
    plan = plan_rank_file([_group([("a", 5), ("b", 7)], gap=3)], ["fp32"])
    assert [(r.source_offset, r.file_offset, r.length) for r in plan.runs[0]] == [(0, 0, 5), (8, 5, 7)]


def test_planned_file_reads_back_every_fragment_with_safetensors(tmp_path: Path) -> None:
    groups = [_group([("layer.w", 6), ("layer.b", 2)], gap=1), _group([("head.w", 4)])]
    fields = ["fp32", "exp_avg", "exp_avg_sq"]
    plan = plan_rank_file(groups, fields)
    # Source tensors per group and field, filled with distinct values.
    sources = [
        {
            f: torch.arange(100 * g + 10 * i, 100 * g + 10 * i + 9, dtype=torch.float32)
            for i, f in enumerate(fields)
        }
        for g in range(2)
    ]
    data = torch.empty(plan.numel, dtype=torch.float32)
    for g, runs in enumerate(plan.runs):
        for run in runs:
            data[run.file_offset : run.file_offset + run.length] = sources[g][run.field][
                run.source_offset : run.source_offset + run.length
            ]
    header = plan.header({"who": "test"})
    path = tmp_path / "rank-00000-of-00001.safetensors"
    write = ShardWrite(path, lambda: iter([header, data.numpy()]), len(header) + 4 * plan.numel)
    write.run()
    assert write.error is None and write.file is not None, write.error
    assert write.file["bytes"] == path.stat().st_size == len(header) + 4 * plan.numel
    assert write.file["sha256"] == sha256_of_file(path)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"who": "test"}
        assert set(f.keys()) == {f"{p}::{fld}" for p in ("layer.w", "layer.b", "head.w") for fld in fields}
        for g, pieces in enumerate(groups):
            for piece in pieces:
                for fld in fields:
                    want = sources[g][fld][piece.offset : piece.offset + piece.length]
                    assert torch.equal(f.get_tensor(f"{piece.name}::{fld}"), want)


def test_a_stream_shorter_than_announced_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    write = ShardWrite(path, lambda: [b"12345"], 10)
    write.run()
    assert write.error is not None and "expected 10" in write.error
    assert not path.exists()


def test_a_failing_stream_leaves_no_torn_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"

    def chunks():  # noqa: ANN202 - a generator that dies half way, as a swap-in error would
        yield b"header"
        raise OSError(5, "Input/output error")

    write = ShardWrite(path, chunks)
    write.run()
    assert write.error is not None and "Input/output error" in write.error
    assert not path.exists()
