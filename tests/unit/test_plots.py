"""Plots of a run: markers from its events, and valid PNG files from its metric histories."""

from __future__ import annotations

import struct

from elastictrain.tools.plots import Marker, make_plots, markers, world_sizes

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_failures_recoveries_and_resizes_are_marked_at_their_steps():
    events = [
        {"event": "attempt_started", "step": 0, "world_size": 2},
        {"event": "eval", "step": 4},
        {"event": "failure", "step": 6, "kind": "worker_died"},
        {"event": "attempt_started", "step": 6, "world_size": 1},
        {"event": "recovered", "step": 5},
        {"event": "attempt_started", "step": 8, "world_size": 1},  # a restart at the same size: no resize
        {"event": "grow", "step": 10},
        {"event": "attempt_started", "step": 10, "world_size": 2},
    ]
    assert world_sizes(events, last_step=12) == [(0, 2.0), (6, 1.0), (8, 1.0), (10, 2.0), (12, 2.0)]
    assert markers(events) == [
        Marker(6, "failure", "worker_died"),
        Marker(6, "resize", "2->1"),
        Marker(5, "recovered", "recovered"),
        Marker(10, "resize", "1->2"),
    ]


def test_each_figure_with_data_is_a_png(tmp_path):
    steps = range(1, 13)
    histories = {
        "loss": [(s, 5.0 / s) for s in steps],
        "eval_loss": [(4, 1.5), (8, 1.0), (12, 0.9)],
        "lr": [(s, 1e-3) for s in steps],
        "samples_per_s": [(s, 10.0 + s) for s in steps],
        "world_size": [(0, 2.0), (6, 1.0), (10, 2.0)],
    }
    written = make_plots(histories, [Marker(6, "failure", "worker_died")], tmp_path / "plots")
    assert [p.name for p in written] == ["loss.png", "lr.png", "throughput.png", "world_size.png"]
    for p in written:
        width, height = png_size(p.read_bytes())
        assert (width, height) == (700, 360)
    assert make_plots({"loss": [(1, 2.0)]}, [], tmp_path / "one") == [tmp_path / "one" / "loss.png"]
