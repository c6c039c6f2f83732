"""The attempt's line and event say the largest resident peak a rank reached by the end of its set-up,
so a user can tell whether building the engine or training sets a rank's memory."""

from __future__ import annotations

from elastictrain.control.specs import set_up_peak_note, slowest_set_up
from elastictrain.host.memory import peak_resident_bytes


def test_the_high_water_mark_is_read_from_the_process_status(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 9000000 kB\nVmHWM:\t 2097152 kB\nVmRSS:\t 1048576 kB\n")
    assert peak_resident_bytes(str(status)) == 2 << 30
    assert peak_resident_bytes(str(tmp_path / "missing")) is None
    assert peak_resident_bytes() is not None  # this process, on Linux


def test_the_largest_ranks_peak_is_reported_beside_the_slowest_parts():
    timings = {
        "w0": {"total_s": 3.0, "engine_s": 2.0, "peak_rss_bytes": float(3 << 30)},
        "w1": {"total_s": 4.0, "engine_s": 1.0, "peak_rss_bytes": float(5 << 29)},
    }
    got = slowest_set_up(timings)
    assert got["setup_s"] == 4.0 and got["engine_s"] == 2.0
    assert got["setup_peak_rss_bytes"] == float(3 << 30)
    assert set_up_peak_note(got["setup_peak_rss_bytes"]) == ", peak 3.00 GiB resident on a rank"


def test_no_peak_is_claimed_where_no_rank_could_read_one():
    unread = slowest_set_up({"w0": {"total_s": 1.0}})["setup_peak_rss_bytes"]
    assert unread == 0.0
    assert set_up_peak_note(unread) == ""


def test_each_ranks_set_up_and_load_times_are_reported_in_rank_order():
    timings = {
        "w1": {"total_s": 0.4, "load_s": 0.2, "load_fetch_s": 0.15},
        "w0": {"total_s": 1.4, "load_s": 1.2, "load_fetch_s": 1.1},
        "w2": {"total_s": 0.3, "load_s": 0.1},  # loaded from disk: no holders asked
    }
    got = slowest_set_up(timings, ["w0", "w1", "w2"])
    assert got["setup_s"] == 1.4 and got["load_s"] == 1.2
    assert got["setup_s_by_rank"] == [1.4, 0.4, 0.3]
    assert got["load_s_by_rank"] == [1.2, 0.2, 0.1]
    assert got["load_fetch_s_by_rank"] == [1.1, 0.15, 0.0]
