"""Naming a slow rank (core/stragglers.py)."""

from __future__ import annotations

from elastictrain.core.stragglers import StragglerWatch, ratios, straggler_remedy


def test_a_rank_slower_than_the_others_median_for_n_steps_is_named_once():
    watch = StragglerWatch(factor=1.3, steps=3)
    seen = [watch.observe({0: 0.10, 1: 0.21, 2: 0.11}) for _ in range(5)]
    assert seen[:2] == [[], []]
    assert [(rank, round(ratio, 2)) for rank, ratio in seen[2]] == [(1, 2.0)]
    assert seen[3:] == [[], []]  # named once while it stays slow


def test_a_one_off_slow_step_is_not_a_straggler():
    watch = StragglerWatch(factor=1.3, steps=3)
    times = [{0: 0.1, 1: 0.1}, {0: 0.3, 1: 0.1}, {0: 0.1, 1: 0.1}, {0: 0.3, 1: 0.1}, {0: 0.3, 1: 0.1}]
    assert all(watch.observe(t) == [] for t in times)


def test_a_rank_back_at_pace_is_named_again_if_it_slows_again():
    watch = StragglerWatch(factor=1.3, steps=1)
    assert watch.observe({0: 0.2, 1: 0.1}) == [(0, 2.0)]
    assert watch.observe({0: 0.1, 1: 0.1}) == []
    assert watch.observe({0: 0.2, 1: 0.1}) == [(0, 2.0)]


def test_off_and_single_rank_name_nobody():
    assert StragglerWatch(factor=0, steps=1).observe({0: 1.0, 1: 0.1}) == []
    assert StragglerWatch(factor=1.3, steps=1).observe({0: 1.0}) == []


def test_the_controller_names_the_straggler_with_its_worker_and_node_in_events_and_run_json(tmp_path):
    from dataclasses import dataclass

    from loop_harness import make_run

    from elastictrain.control.stragglers import Stragglers

    @dataclass
    class Worker:
        worker_id: str
        node_id: str

    r = make_run(tmp_path, "failure.straggler_steps=2")
    watch = Stragglers(r.controller.cfg, r.controller.recorder, r.group)
    watch.attach([Worker("w0", "node-a"), Worker("w1", "node-b"), Worker("w2", "node-c")])
    results = [{"rank": 0, "forward_s": 0.1}, {"rank": 1, "forward_s": 0.25}, {"rank": 2, "forward_s": 0.1}]
    assert watch.note(0, results) == {"straggler_ratio": 2.5}
    watch.note(1, results)
    (event,) = r.events("straggler")
    assert (event["rank"], event["worker"], event["node"], event["step"]) == (1, "w1", "node-b", 2)
    assert "rank 1 (worker w1, node node-b) is a straggler: its forward passes took 2.50x" in event["message"]
    assert r.run_dir.read_info().extra["stragglers"][0]["worker"] == "w1"


def test_a_warm_spare_replaces_a_straggler_at_once():
    r = straggler_remedy(world=3, min_workers=3, spare_ready=True, now_s=2.0, even_s=1.0, ratio=2.0)
    assert r.action == "replace"


def test_without_a_spare_a_straggler_is_dropped_only_where_the_smaller_world_is_faster():
    # 3 ranks at 1.0 s before it slowed, 2.0 s now: 2 ranks take 1.5 s.
    drop = straggler_remedy(world=3, min_workers=2, spare_ready=False, now_s=2.0, even_s=1.0, ratio=2.0)
    assert drop.action == "drop" and "2 ranks take about 1.5s a step against 2s now" in drop.why
    # 1.2 s now: 2 ranks would take 1.5 s, slower than keeping it.
    keep = straggler_remedy(world=3, min_workers=2, spare_ready=False, now_s=1.2, even_s=1.0, ratio=1.4)
    assert keep.action == "keep" and "would take about 1.5s a step against 1.2s now" in keep.why
    # Not below min_workers, however slow.
    floor = straggler_remedy(world=2, min_workers=2, spare_ready=False, now_s=9.0, even_s=1.0, ratio=9.0)
    assert floor.action == "keep" and "scaling.min_workers" in floor.why


def test_without_a_measured_even_pace_the_others_pace_is_the_ratio_s_share_of_the_step():
    # 4 ranks, 3.0 s a step with one at 3x the others: they run at 1.0 s; 3 ranks take 1.33 s.
    r = straggler_remedy(world=4, min_workers=1, spare_ready=False, now_s=3.0, even_s=None, ratio=3.0)
    assert r.action == "drop" and "about 1.33s" in r.why


def test_with_pipeline_stages_a_rank_is_compared_with_its_stage_in_the_other_replicas_only():
    # P 2 x D 2: ranks 0 and 2 hold stage 0 (a light one), ranks 1 and 3 stage 1 (with the head, twice
    # the work). Across stages nobody is slow; rank 2 at 2x its stage peer is.
    even = {0: 1.0, 1: 2.0, 2: 1.0, 3: 2.0}
    assert ratios(even, stages=2) == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert ratios(even)[1] > 1.3  # compared with every rank, the heavier stage would look slow
    assert ratios({0: 1.0, 1: 2.0, 2: 2.0, 3: 2.0}, stages=2)[2] == 2.0
    assert ratios({0: 1.0, 1: 2.0}, stages=2) == {0: 1.0, 1: 1.0}  # one replica: no peer, nobody named
    watch = StragglerWatch(factor=1.3, steps=2)
    slow = {0: 1.0, 1: 2.0, 2: 2.1, 3: 2.0}
    assert watch.observe(slow, stages=2) == []
    assert watch.observe(slow, stages=2) == [(2, 2.1)]
