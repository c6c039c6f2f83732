"""Tensor-parallel layouts: whole replicas of N ranks read one micro-batch each, on one node each, and
the config says what a layout needs (multiples of N, heads that split)."""

from __future__ import annotations

import json

import pytest
import torch

from elastictrain.checkpoint.tensor_slices import TensorSlice, join, parse
from elastictrain.config import ConfigError, load_config, valid_world_sizes
from elastictrain.config.deepspeed_config import build_deepspeed_config
from elastictrain.core.batch import plan_batch, workable_world_sizes
from elastictrain.core.data_order import micro_batch_positions
from elastictrain.core.losses import replica_results, step_loss
from elastictrain.core.policy import ScalingRules
from elastictrain.core.replicas import replica_order, usable_workers


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    return str(e.value)


def test_the_global_batch_splits_over_replicas_and_a_replicas_ranks_read_the_same_positions():
    plan = plan_batch(24, 4, 4, tensor_parallel=2)
    assert plan is not None
    assert (plan.data_parallel, plan.micro_batch_size, plan.grad_accum_steps) == (2, 4, 3)
    assert plan.global_batch_size == 24
    read: list[int] = []
    for micro in range(plan.grad_accum_steps):
        for rank in range(4):
            positions = list(micro_batch_positions(5, plan, rank, micro))
            if rank % 2:  # the second rank of each replica reads what the first did
                assert positions == list(micro_batch_positions(5, plan, rank - 1, micro))
            else:
                read.extend(positions)
    assert sorted(read) == list(range(5 * 24, 6 * 24))  # every position of the step, once


def test_a_tensor_parallel_plan_reads_the_same_samples_as_data_parallel_alone_at_the_same_replicas():
    tp = plan_batch(24, 4, 4, tensor_parallel=2)
    dp = plan_batch(24, 4, 2)
    assert tp is not None and dp is not None
    for micro in range(tp.grad_accum_steps):
        for rank in range(4):
            assert micro_batch_positions(3, tp, rank, micro) == micro_batch_positions(3, dp, rank // 2, micro)


def test_world_sizes_are_whole_replicas():
    assert plan_batch(24, 4, 3, tensor_parallel=2) is None
    assert workable_world_sizes(24, 4, 2, 8, tensor_parallel=2) == [2, 4, 6, 8]
    rules = ScalingRules(2, 6, 24, 4, 3, 60.0, tensor_parallel=2)
    assert rules.best_size(5) == 4
    assert rules.smallest_workable() == 2


def test_replicas_form_on_one_node_each_and_survivors_keep_their_places():
    nodes = ["a", "b", "a", "b", "c"]
    assert usable_workers(nodes, 2) == 4
    assert replica_order(nodes, 4, 2) == [0, 2, 1, 3]
    assert replica_order(nodes, 6, 2) is None  # node c holds one worker: no third replica
    assert replica_order(["a", "a", "a", "b"], 2, 2) == [0, 1]


def test_a_replica_counts_once_in_the_loss_and_the_ledger():
    results = [
        {
            "rank": r,
            "replica_ranks": 2,
            "loss": 1.0 + r // 2,
            "loss_sum": 10.0 * (1 + r // 2),
            "target_tokens": 10,
        }
        for r in range(4)
    ]
    leads = replica_results(results)
    assert [r["rank"] for r in leads] == [0, 2]
    assert step_loss(leads) == pytest.approx(1.5)
    assert len(replica_results([{"rank": 0}, {"rank": 1}])) == 2  # no degree said: every rank its own


def test_the_deepspeed_config_asks_autotp_for_the_degree_and_counts_every_rank_in_the_batch():
    cfg = load_config(None, ["scaling.tensor_parallel=2", "scaling.min_workers=4", "scaling.max_workers=4"])
    ds = build_deepspeed_config(cfg, 4, 3, 2, tensor_parallel=2)
    assert ds["tensor_parallel"] == {"autotp_size": 2}
    assert ds["train_batch_size"] == 48  # read before the replicas exist: every rank counts as one
    assert "tensor_parallel" not in build_deepspeed_config(load_config(None), 4, 3, 2)


def test_world_sizes_of_a_tensor_parallel_config_are_multiples_of_the_degree():
    cfg = load_config(None, ["scaling.tensor_parallel=2", "scaling.min_workers=2", "scaling.max_workers=6"])
    assert valid_world_sizes(cfg) == [2, 4, 6]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["scaling.tensor_parallel=2", "scaling.min_workers=3", "scaling.max_workers=4"],
            "scaling.min_workers: got 3 with scaling.tensor_parallel 2; it counts ranks and must be",
        ),
        (["scaling.tensor_parallel=2", "scaling.spare_workers=1"], "scaling.spare_workers: got 1"),
        (["scaling.tensor_parallel=0"], "scaling.tensor_parallel: got 0; expected a whole number >= 1"),
        (["scaling.tensor_parallel=2", "model.lora.enabled=true"], "model.lora.enabled: LoRA with scaling"),
        (
            ["scaling.tensor_parallel=2", "model.pretrained=/nonexistent", "deepspeed.zero_stage=3"],
            "deepspeed.zero_stage: got 3 with model.pretrained and scaling.tensor_parallel 2",
        ),
        (
            ["scaling.tensor_parallel=3", "scaling.min_workers=3", "scaling.max_workers=3"],
            "model.hf_config.num_attention_heads: got 4; scaling.tensor_parallel 3 splits it between 3 ranks",
        ),
    ],
)
def test_a_layout_the_config_cannot_hold_is_refused_naming_the_field(overrides, expected):
    assert expected in problems(*overrides)


def test_the_users_deepspeed_json_sets_the_degree_and_a_conflict_names_both(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"tensor_parallel": {"autotp_size": 2}}))
    cfg = load_config(None, [f"deepspeed.config_file={f}"])
    assert cfg.scaling.tensor_parallel == 2
    text = problems(
        f"deepspeed.config_file={f}",
        "scaling.tensor_parallel=4",
        "scaling.min_workers=4",
        "scaling.max_workers=4",
    )
    assert "tensor_parallel.autotp_size is 2 in ds.json but scaling.tensor_parallel is 4" in text


def test_slices_are_named_by_their_place_and_join_back_into_the_whole():
    whole = torch.arange(24.0).view(4, 6)
    for dim in (0, 1):
        pieces = [TensorSlice(dim, i, 2) for i in range(2)]
        names = [p.qualify("layer.weight") for p in pieces]
        assert [parse(n) for n in names] == [("layer.weight", p) for p in pieces]
        assert torch.equal(join([p.cut(whole, "w") for p in pieces], dim), whole)
    assert parse("norm.weight") == ("norm.weight", None)
    with pytest.raises(ValueError, match="does not split into 4 even slices"):
        TensorSlice(1, 0, 4).cut(whole, "w")


def _save_rank_files(folder, whole: dict[str, torch.Tensor], dims: dict[str, int], tp: int, dp: int) -> list:
    """Fragment files as ranks of a (TP tp, DP dp) layout save them: each slice split over dp ranks."""
    from safetensors.torch import save_file

    from elastictrain.checkpoint.zero_state import Fragment, rank_file

    files = []
    for rank in range(tp * dp):
        t, d = rank % tp, rank // tp
        tensors, fragments = {}, {}
        for name, value in whole.items():
            if name in dims:
                piece = TensorSlice(dims[name], t, tp)
                held, saved = piece.cut(value, name).contiguous(), piece.qualify(name)
            else:
                held, saved = value, name
            flat = held.reshape(-1)
            part = flat.numel() // dp
            start = d * part
            tensors[f"{saved}::fp32"] = flat[start : start + part].clone()
            tensors[f"{saved}::exp_avg"] = flat[start : start + part] * 2
            fragments[saved] = Fragment(start, part, flat.numel(), tuple(held.shape))
        file_name, metadata = rank_file(rank, tp * dp, fragments)
        save_file(tensors, str(folder / file_name), metadata=metadata)
        files.append(folder / file_name)
    return files


def test_a_checkpoint_of_tensor_parallel_slices_reads_whole_and_as_any_other_layouts_slices(tmp_path):
    from elastictrain.checkpoint.zero_state import FragmentReader

    whole = {"q.weight": torch.randn(8, 6), "o.weight": torch.randn(6, 8), "norm.weight": torch.randn(6)}
    dims = {"q.weight": 0, "o.weight": 1}
    reader = FragmentReader(_save_rank_files(tmp_path, whole, dims, tp=2, dp=2))
    assert sorted(reader.params) == sorted(whole)
    for name, value in whole.items():
        assert torch.equal(reader.full(name), value)
        assert torch.equal(reader.full(name, "exp_avg"), value * 2)
    for tp in (1, 2, 4):
        for name, dim in dims.items():
            for index in range(tp):
                target = TensorSlice(dim, index, tp)
                qualified = target.qualify(name) if tp > 1 else name
                expected = target.cut(whole[name], name).reshape(-1)
                assert reader.has(qualified) and reader.numel(qualified) == expected.numel()
                half = expected.numel() // 2  # a ZeRO partition of it: any element range
                assert torch.equal(
                    reader.read(qualified, "fp32", half, expected.numel() - half), expected[half:]
                )
    assert reader.fields("q.weight#tp0of4d0") == ["fp32", "exp_avg"]


def test_the_memory_estimate_gives_each_rank_its_share_of_the_sliced_layers_and_zero_the_replicas():
    from elastictrain.core.memory_estimate import estimate_rank_memory

    def host(world: int, tp: int, sliced: int, stage: int) -> int:
        estimate = estimate_rank_memory(
            10**8,
            0,
            world,
            zero_stage=stage,
            precision="fp32",
            baseline_bytes=0,
            allocator="system",
            tensor_parallel=tp,
            sliced_params=sliced,
        )
        return estimate.host_bytes

    # ZeRO-0: 20 bytes a parameter, whole on every rank; TP 2 halves what is sliced, at any world size.
    assert host(2, 1, 0, 0) == 20 * 10**8
    assert host(2, 2, 10**8, 0) == host(4, 2, 10**8, 0) == 10 * 10**8
    assert host(2, 2, 6 * 10**7, 0) == 20 * 4 * 10**7 + 20 * 3 * 10**7
    # ZeRO-3 divides over the replicas: TP 2 x DP 2 holds what DP 4 holds when everything is sliced.
    assert host(4, 2, 10**8, 3) == host(4, 1, 0, 3)
    with pytest.raises(ValueError, match="expected a divisor of 3"):
        host(3, 2, 0, 0)


def test_auto_picks_the_smallest_degree_that_fits_and_says_why():
    from elastictrain.core.replicas import pick_degree

    assert pick_degree([1, 2, 4], lambda n: n >= 2) == (
        2,
        "2: the smallest degree whose memory estimate fits the nodes; 1 would not fit",
    )
    assert pick_degree([1, 2], lambda n: None)[0] == 1  # memory unknown: the smallest
    n, why = pick_degree([1, 2, 4], lambda n: False)
    assert n == 4 and "no degree of 1, 2, 4 fits" in why


def test_auto_is_accepted_where_some_degree_fits_the_config_and_refused_where_none_does():
    cfg = load_config(
        None, ["scaling.tensor_parallel=auto", "scaling.min_workers=2", "scaling.max_workers=4"]
    )
    from elastictrain.config.tensor_parallel_check import tensor_parallel_candidates

    assert tensor_parallel_candidates(cfg) == [1, 2]  # 4 would leave min_workers=2 no whole replica
    text = problems(
        "scaling.tensor_parallel=auto",
        "scaling.min_workers=3",
        "scaling.max_workers=3",
        "model.hf_config.num_attention_heads=2",
        "model.hf_config.num_key_value_heads=2",
        "training.global_batch_size=8",
    )
    assert "scaling.tensor_parallel: got 'auto' but no degree fits" in text


def test_a_restart_under_auto_takes_the_smallest_degree_that_fits_at_the_size_it_can_run():
    from elastictrain.core.replicas import size_and_degree

    rules = ScalingRules(2, 4, 12, 2, 3, 60.0)
    usable = {1: 3, 2: 2}.get  # three warm workers: three ranks alone, or one replica of two

    # Degree 1 fits only at 4 ranks and more: three do not fit, so one replica of two at degree 2.
    n, size, why = size_and_degree(rules, [1, 2], lambda n: usable(n, 0), lambda n, w: n > 1 or w >= 4)
    assert (n, size) == (2, 2)
    assert why == "2, the smallest degree whose memory estimate fits at 2 ranks; 1 at 3 ranks would not fit"
    assert size_and_degree(rules, [1, 2], lambda n: usable(n, 0), lambda n, w: None)[:2] == (1, 3)
    assert size_and_degree(rules, [1, 2], lambda n: usable(n, 0), lambda n, w: False)[:2] == (2, 2)
    assert size_and_degree(rules, [2], lambda n: 1, lambda n, w: True) is None  # no whole replica
