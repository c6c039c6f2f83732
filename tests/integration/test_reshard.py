"""Reshard ZeRO-3 state N -> M by loading: the loaded state equals the saved state, tensor by tensor."""

from __future__ import annotations

import json

import pytest
from helpers import offload_overrides, tiny_config
from probe import ProbeGroup, assert_same_state, save_checkpoint, train_steps

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_reshard_2_to_3_to_2_and_2_to_1_preserves_weights_and_adam_moments(
    probes: ProbeGroup, tmp_path, offload
):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = tiny_config(tmp_path / "run", *offload_overrides(offload, nvme))
    workers = probes  # the module's 3 warm actors: each setup below is a new attempt on them
    try:
        workers.setup(cfg, 2)
        train_steps(workers, range(3))
        w2 = save_checkpoint(workers, cfg, tmp_path / "w2", 3)

        workers.setup(cfg, 3, str(w2), 3)  # grow 2 -> 3
        w3 = save_checkpoint(workers, cfg, tmp_path / "w3", 3)
        assert_same_state(w2, w3)

        workers.setup(cfg, 2, str(w3), 3)  # shrink 3 -> 2
        w32 = save_checkpoint(workers, cfg, tmp_path / "w32", 3)
        assert_same_state(w3, w32)

        workers.setup(cfg, 1, str(w2), 3)  # shrink 2 -> 1
        w1 = save_checkpoint(workers, cfg, tmp_path / "w1", 3)
        assert assert_same_state(w2, w1) == ["fp32", "exp_avg", "exp_avg_sq"]

        # The optimizer step counter travels too, and training continues from the resharded state.
        assert json.loads((w1 / "manifest.json").read_text())["engine_state"]["optimizer_step"] == 3
        train_steps(workers, range(3, 4))
    finally:
        workers.teardown()  # leaves the attempt (and its NVMe swap files) before tmp_path goes


@pytest.mark.parametrize("max_mb", [None, 1.0])
def test_in_memory_snapshots_are_kept_only_where_their_copies_fit_the_memory_budget(
    probes: ProbeGroup, tmp_path, max_mb
):
    import ray

    extra = [] if max_mb is None else [f"checkpoint.max_host_memory_mb={max_mb}"]
    cfg = tiny_config(tmp_path / "run", *extra)
    probes.setup(cfg, 2, snapshot_every=1)
    try:
        for step in range(3):
            results = ray.get([a.train_step.remote(step, True) for a in probes.active], timeout=300)
        ray.get([a.snapshot_now.remote() for a in probes.active], timeout=120)  # the last copy is complete
        held = [
            [h for h in hs if h["attempt"] == probes.attempt]  # a worker keeps earlier attempts' too
            for hs in ray.get([a.memory_holdings.remote() for a in probes.active], timeout=60)
        ]
    finally:
        probes.teardown()
    offs = [r["memory"]["off"] for r in results]
    cpu = [r["memory"]["cpu_s"] for r in results]  # a snapshot's CPU seconds (the schedule's measure)
    if max_mb is None:  # half the available memory: the tiny model's copies fit, the last two are held
        assert offs == ["", ""] and all(c > 0 for c in cpu)
        assert [sorted(h["step"] for h in hs) for hs in held] == [[2, 3], [2, 3]]
    else:  # 1 MiB: the first copy measured the slice, was dropped, and nothing is held or copied again
        assert all("in-memory snapshots need" in o and "1 MiB checkpointing may use" in o for o in offs)
        assert held == [[], []] and cpu == [0.0, 0.0]
