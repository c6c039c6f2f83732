"""core.memory_estimate: the per-rank memory estimate printed at start and the refusal it backs."""

from __future__ import annotations

import pytest

from elastictrain.core.memory_estimate import GIB, estimate_rank_memory, memory_shortfall, ranks_that_fit

B = 1_000_000_000  # parameters


def _est(**kw):  # noqa: ANN003, ANN202
    args = dict(zero_stage=3, precision="fp32", baseline_bytes=0)
    args.update(kw)
    return estimate_rank_memory(B, 0, 2, **args)


def test_zero3_fp32_adam_is_16_bytes_per_parameter_divided_by_the_world_size() -> None:
    e = _est()
    assert e.bytes_per_param == 16  # weights updated in place: no separate fp32 master copy
    assert e.host_bytes == 16 * B // 2 and e.device_bytes == 0 and e.nvme_bytes == 0


def test_an_offloaded_optimizer_keeps_its_own_fp32_copy_20_bytes_per_parameter() -> None:
    assert _est(offload_optimizer="cpu").host_bytes == 20 * B // 2


def test_mixed_precision_is_18_bytes_per_parameter() -> None:
    assert _est(precision="bf16").host_bytes == 18 * B // 2


def test_nvme_optimizer_offload_moves_the_12_optimizer_bytes_out_of_host_memory() -> None:
    e = _est(offload_optimizer="nvme")
    assert e.nvme_bytes == 12 * B // 2
    assert e.host_bytes == (4 + 4) * B // 2  # weights and the fp32 gradients stay


def test_on_a_gpu_the_offloaded_optimizer_and_its_gradients_live_on_the_host() -> None:
    e = _est(precision="bf16", offload_optimizer="cpu", use_gpu=True)
    assert e.device_bytes == 2 * B // 2
    assert e.host_bytes == (12 + 4) * B // 2


def test_lower_stages_divide_less_and_the_largest_layer_and_baseline_add_on_top() -> None:
    stage1 = _est(zero_stage=1)
    assert stage1.host_bytes == (4 + 4) * B + 12 * B // 2
    e = estimate_rank_memory(B, 1000, 4, zero_stage=3, precision="fp32", baseline_bytes=GIB)
    # The largest layer's weights gathered whole and its whole gradient: 4 + 4 bytes in fp32.
    assert e.host_bytes == 16 * B // 4 + 8000 + GIB
    half = estimate_rank_memory(B, 1000, 4, zero_stage=3, precision="bf16", baseline_bytes=0)
    assert half.host_bytes == 18 * B // 4 + 4000  # DeepSpeed's 4 bytes: fp16 weights and gradients
    assert "1000.0M parameters at world size 4" in e.describe()


def test_bad_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size: got 0"):
        estimate_rank_memory(B, 0, 0, zero_stage=3, precision="fp32")


def test_ranks_that_fit_caps_each_node_by_its_slots_and_its_memory() -> None:
    assert ranks_that_fit([24 * GIB, 24 * GIB], [2, 8], 10 * GIB) == 4
    assert ranks_that_fit([24 * GIB], [1], 1 * GIB) == 1
    assert ranks_that_fit([8 * GIB], [4], 10 * GIB) == 0


def test_too_few_slots_is_a_wait_for_capacity_not_a_memory_shortfall() -> None:
    # Two one-CPU nodes with plenty of memory and min_workers=3: capacity may join later.
    assert memory_shortfall([24 * GIB, 24 * GIB], [1, 1], 1 * GIB, wanted=3) is None
    # Enough slots, not enough memory: that is what the run is refused for.
    assert memory_shortfall([24 * GIB, 24 * GIB], [4, 4], 10 * GIB, wanted=5) == 4
    # Slots and memory both short: memory alone would still allow only 1 of the 2 slots.
    assert memory_shortfall([12 * GIB], [2], 10 * GIB, wanted=3) == 1
    assert memory_shortfall([24 * GIB], [2], 1 * GIB, wanted=2) is None


def test_in_memory_snapshots_are_counted_apart_as_copies_of_the_ranks_slice() -> None:
    from elastictrain.core.snapshot_plan import SLICES_HELD

    off, on = _est(), _est(memory_snapshots=True)
    assert off.snapshot_bytes == 0 and on.host_bytes == off.host_bytes  # optional: never a refusal
    assert on.snapshot_bytes == SLICES_HELD * 12 * B // 2  # fp32 weights + 2 moments, over 2 ranks
    assert "in-memory snapshots up to" in on.describe() and "in-memory" not in off.describe()


def test_cpu_runs_also_need_what_the_allocator_keeps_of_the_steps_freed_temporaries() -> None:
    from elastictrain.core.memory_estimate import RETAINED_BYTES

    cpu = _est()
    assert cpu.retained_bytes == RETAINED_BYTES["jemalloc"]["none"] * B // 2
    assert cpu.host_need == cpu.host_bytes + cpu.retained_bytes  # the bound itself is unchanged
    assert "freed step temporaries the allocator keeps" in cpu.describe()
    # Less with the optimizer on NVMe (its temporaries live in the swap buffers), none on a GPU.
    assert _est(offload_optimizer="nvme").retained_bytes == RETAINED_BYTES["jemalloc"]["nvme"] * B // 2
    # glibc's malloc (scaling.worker_allocator=system) keeps more.
    glibc = _est(allocator="system").retained_bytes
    assert glibc == RETAINED_BYTES["system"]["none"] * B // 2 > cpu.retained_bytes
    gpu = _est(use_gpu=True)
    assert gpu.retained_bytes == 0 and gpu.host_need == gpu.host_bytes


def test_a_1b_model_without_offload_fits_a_24_gib_two_slot_machine_with_jemalloc_not_glibcs_malloc() -> None:
    params, layer = 953_000_000, 65_536_000  # the 1B preset (its embedding is the largest layer)
    args = dict(zero_stage=3, precision="fp32", baseline_bytes=int(0.9 * GIB))
    glibc = estimate_rank_memory(params, layer, 2, allocator="system", **args)
    jemalloc = estimate_rank_memory(params, layer, 2, allocator="jemalloc", **args)
    nvme = estimate_rank_memory(params, layer, 2, offload_optimizer="nvme", allocator="system", **args)
    node = [int(23.4 * GIB)]
    # With glibc's malloc the bound alone (8.3 GiB a rank) let this run start; it ran out of memory in
    # its first step. With jemalloc it peaked at 10.4 GiB a rank.
    assert memory_shortfall(node, [2], glibc.host_bytes, wanted=2) is None
    assert memory_shortfall(node, [2], glibc.host_need, wanted=2) == 1
    assert memory_shortfall(node, [2], jemalloc.host_need, wanted=2) is None
    assert memory_shortfall(node, [2], nvme.host_need, wanted=2) is None


def test_the_swap_buffers_hold_deepspeeds_largest_sub_group_which_may_pass_sub_group_size() -> None:
    from elastictrain.core.memory_estimate import largest_sub_group

    # Closed once it reaches the size: the last partition added may carry a sub-group past it.
    assert largest_sub_group([30, 30, 10, 45, 5], 50) == 60
    assert largest_sub_group([10, 10, 80], 50) == 100
    assert largest_sub_group([10, 10, 5], 50) == 25  # all of it in one sub-group
    assert largest_sub_group([40, 40, 20], 50) == 80


def test_largest_sub_group_follows_deepspeeds_own_grouping() -> None:
    from types import SimpleNamespace

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from elastictrain.core.memory_estimate import largest_sub_group

    numels = [7, 52, 3, 3, 40, 11, 64, 2, 9, 30]
    params = [SimpleNamespace(partition_numel=lambda n=n: n) for n in numels]
    for size in (10, 50, 60, 1000):
        groups = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(
            SimpleNamespace(sub_group_size=size), params
        )
        assert largest_sub_group(numels, size) == max(sum(p.partition_numel() for p in g) for g in groups)


def test_with_tensor_parallelism_a_node_holds_whole_replicas_only() -> None:
    # 30 GiB of 10 GiB ranks is 3 ranks, but one replica of 2 at degree 2 (its ranks share the node).
    assert ranks_that_fit([30 * GIB], [4], 10 * GIB, tensor_parallel=2) == 2
    assert ranks_that_fit([30 * GIB, 30 * GIB], [3, 4], 1 * GIB, tensor_parallel=2) == 6
    # 4 ranks wanted at degree 2: memory holds 2 on each node, so 4 fit; 3 per node at degree 1 would.
    assert memory_shortfall([25 * GIB, 25 * GIB], [4, 4], 10 * GIB, wanted=4, tensor_parallel=2) is None
    assert memory_shortfall([25 * GIB, 15 * GIB], [4, 4], 10 * GIB, wanted=4, tensor_parallel=2) == 2
