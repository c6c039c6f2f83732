"""The 3-D layout's cost model and choice (core/parallel_layout.py) over a table of models, devices, networks
and world sizes, and the split of a model's layers into balanced pipeline stages."""

from __future__ import annotations

import itertools

import pytest

from elastictrain.core.layout import ModelShape
from elastictrain.core.parallel_layout import (
    CLOSE,
    GIB,
    Batch,
    Degrees,
    Hardware,
    candidates,
    choose_parallel_layout,
    estimate,
    split_stages,
)

# (shape, attention heads, key/value heads): Llama 3.2 1B, Llama 2 7B, Llama 2 70B.
MODELS = {
    "1B": (ModelShape(1_236_000_000, 262_668_288, 2048, 8192, 512, 16, 128256), 32, 8),
    "7B": (ModelShape(6_738_000_000, 131_072_000, 4096, 11008, 4096, 32, 32000), 32, 32),
    "70B": (ModelShape(68_977_000_000, 262_144_000, 8192, 28672, 1024, 80, 32000), 64, 8),
}
NETWORKS = {"infiniband": 50e9, "ethernet": 3e9}  # bytes/s a rank between nodes: 400 and 25 Gb/s
DEVICES = {"24GiB": 24 * GIB, "80GiB": 80 * GIB}
BATCH = Batch(global_batch=512, seq_len=4096, micro_batch=1, precision="bf16")


def _hw(memory: int, network: float) -> Hardware:
    return Hardware(
        memory, flops=400e12, intra_node_bytes_s=300e9, inter_node_bytes_s=network, ranks_per_node=8
    )


TABLE = list(itertools.product(MODELS, DEVICES, NETWORKS, (8, 32, 64)))


@pytest.mark.parametrize(("model", "device", "network", "world"), TABLE)
def test_the_choice_fits_and_no_fitting_candidate_is_estimated_faster(model, device, network, world):
    shape, heads, kv = MODELS[model]
    hw = _hw(DEVICES[device], NETWORKS[network])
    best, runner_up = choose_parallel_layout(shape, world, hw, BATCH, heads, kv)
    others = [estimate(shape, d, hw, BATCH) for d in candidates(shape, world, hw, heads, kv)]
    if not best.fits:  # nothing fits: the least memory is named
        assert not any(e.fits for e in others)
        assert best.memory_bytes == min(e.memory_bytes for e in others)
        return
    assert best.degrees.ranks == world
    # None is estimated faster by more than CLOSE; one faster at all splits a replica over more ranks.
    size = best.degrees.pipeline * best.degrees.tensor
    assert all(best.step_s <= e.step_s * (1 + CLOSE) for e in others if e.fits)
    assert all(
        e.degrees.pipeline * e.degrees.tensor >= size for e in others if e.fits and e.step_s < best.step_s
    )
    if runner_up is not None:
        assert runner_up.fits and runner_up.degrees != best.degrees
        assert runner_up.step_s * (1 + CLOSE) >= best.step_s  # faster only within a tie


def test_a_small_model_on_one_node_trains_data_parallel():
    shape, heads, kv = MODELS["1B"]
    best, runner_up = choose_parallel_layout(shape, 8, _hw(80 * GIB, 50e9), BATCH, heads, kv)
    assert (best.degrees.pipeline, best.degrees.tensor, best.degrees.replicas) == (1, 1, 8)
    assert runner_up is not None and "about" in runner_up.describe()


def test_a_slow_network_moves_a_7b_model_to_pipelines_where_a_fast_one_keeps_more_data_parallelism():
    shape, heads, kv = MODELS["7B"]
    slow, _ = choose_parallel_layout(shape, 32, _hw(80 * GIB, 3e9), BATCH, heads, kv)
    fast, _ = choose_parallel_layout(shape, 32, _hw(80 * GIB, 50e9), BATCH, heads, kv)
    assert slow.degrees.pipeline > 1 and slow.degrees.zero_stage <= 1
    assert slow.degrees.replicas <= fast.degrees.replicas
    # Across slow links ZeRO-3's gathers cost more than the pipeline's bubble and boundaries.
    zero3 = estimate(shape, Degrees(1, 1, 32, 3), _hw(80 * GIB, 3e9), BATCH)
    assert zero3.step_s > slow.step_s and zero3.data_s > slow.bubble_s + slow.pipeline_s


def test_70b_needs_the_model_split_where_data_parallelism_alone_does_not_fit():
    shape, heads, kv = MODELS["70B"]
    hw = _hw(80 * GIB, 50e9)
    best, _ = choose_parallel_layout(shape, 64, hw, BATCH, heads, kv)
    assert best.fits and best.degrees.pipeline * best.degrees.tensor > 1
    assert not estimate(shape, Degrees(1, 1, 64, 3), hw, BATCH).fits


def test_pipelines_run_zero_0_or_1_and_tensor_parallelism_stays_within_a_node_and_splits_heads():
    shape, heads, kv = MODELS["70B"]
    found = candidates(shape, 64, _hw(80 * GIB, 50e9), heads, kv)
    assert all(d.zero_stage <= 1 for d in found if d.pipeline > 1)
    assert {d.tensor for d in found} == {1, 2, 4, 8}  # 8 key/value heads, 8 ranks a node
    assert all(d.ranks == 64 for d in found)
    assert Degrees(1, 1, 64, 3) in found and Degrees(2, 1, 32, 3) not in found


def test_more_micro_batches_shrink_the_bubble():
    shape, _, _ = MODELS["7B"]
    hw = _hw(80 * GIB, 50e9)
    few = estimate(shape, Degrees(4, 1, 8, 1), hw, Batch(64, 4096, 4))
    many = estimate(shape, Degrees(4, 1, 8, 1), hw, Batch(64, 4096, 1))
    assert many.bubble_s / many.compute_s < few.bubble_s / few.compute_s
    assert few.bubble_s / few.compute_s == pytest.approx(3 / 2)  # 2 micro-batches a replica, 4 stages


@pytest.mark.parametrize(
    ("costs", "stages", "starts"),
    [
        ([1] * 8, 4, [0, 2, 4, 6]),
        ([10, 1, 1, 1, 1, 10], 3, [0, 1, 5]),  # the embedding's and the head's heavy ends get stages alone
        ([5, 1, 1, 1, 1, 1], 2, [0, 1]),
        ([3, 3, 3], 3, [0, 1, 2]),
        ([4, 4, 4, 4], 1, [0]),
    ],
)
def test_layers_split_into_contiguous_stages_with_the_largest_as_small_as_it_can_be(costs, stages, starts):
    assert split_stages(costs, stages) == starts


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="5 pipeline stages for 4 layers; expected 1 to 4"):
        split_stages([1, 1, 1, 1], 5)
