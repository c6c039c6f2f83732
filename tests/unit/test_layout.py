"""The automatic layout (core/layout.py) over a table of models, devices and world sizes, and its activation
estimate against what transformers' Llama keeps for backward."""

from __future__ import annotations

import pytest

from elastictrain.core.layout import (
    LADDER,
    MIN_MICRO_TOKENS,
    Layout,
    Memory,
    ModelShape,
    choose_layout,
    kept_activation_bytes,
    need,
)
from elastictrain.core.memory_estimate import GIB


def llama(hidden: int, intermediate: int, layers: int, kv_heads: int, heads: int, vocab: int) -> ModelShape:
    kv = hidden // heads * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden
    embed = vocab * hidden
    return ModelShape(
        params=2 * embed + layers * per_layer + hidden,
        largest_layer=embed,
        hidden=hidden,
        intermediate=intermediate,
        kv_width=kv,
        layers=layers,
        vocab=vocab,
        zero3_live=10**9,
    )


MODELS = {
    "1B": llama(2048, 5632, 16, 16, 16, 32000),  # conf/gpu-llama-1b.yaml
    "7B": llama(4096, 11008, 32, 32, 32, 32000),  # Llama 2 7B
    "13B": llama(5120, 13824, 40, 40, 40, 32000),  # Llama 2 13B
    "70B": llama(8192, 28672, 80, 8, 64, 128256),  # Llama 3 70B
}
DEVICES = {"24GiB": 24 * GIB, "80GiB": 80 * GIB, "141GiB": 141 * GIB}
HOST_PER_RANK = 240 * GIB  # a 2 TiB node of 8 GPUs
WORLDS = [1, 8, 64]


def choose(model: str, device: str, world: int, fixed: dict | None = None, **kw):
    return choose_layout(
        MODELS[model],
        Memory(DEVICES[device], kw.pop("host", HOST_PER_RANK), kw.pop("nvme", False)),
        world_size=world,
        data_parallel=world,
        global_batch_size=kw.pop("global_batch_size", 64 * world if world > 1 else 64),
        seq_len=kw.pop("seq_len", 2048),
        precision=kw.pop("precision", "bf16"),
        fixed=fixed or {},
    )


def rung(layout: Layout) -> int:
    return LADDER.index(
        Layout(
            layout.zero_stage, layout.offload_optimizer, layout.offload_param, layout.activation_checkpointing
        )
    )


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", WORLDS)
def test_the_choice_fits_and_every_cheaper_setting_did_not(model: str, device: str, world: int) -> None:
    choice = choose(model, device, world)
    if not choice.fits:
        return  # test_nothing_fits_says_so covers these
    assert choice.need.device <= choice.usable_device and choice.need.host <= choice.usable_host
    per_replica = 64
    for cheaper in LADDER[: rung(choice.layout)]:
        if "nvme" in (cheaper.offload_optimizer, cheaper.offload_param) or cheaper.zero_stage == 0:
            continue  # no NVMe path given; bf16 needs ZeRO stage 1 or more
        enough = [
            m for m in range(1, per_replica + 1) if per_replica % m == 0 and m * 2048 >= MIN_MICRO_TOKENS
        ]
        n = need(MODELS[model], cheaper, world, enough[0] * 2048, "bf16", True)
        assert n.device > choice.usable_device or n.host > choice.usable_host, cheaper


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world", WORLDS)
def test_more_device_memory_never_chooses_a_costlier_setting(model: str, world: int) -> None:
    rungs = [rung(choose(model, d, world).layout) for d in DEVICES]
    assert rungs == sorted(rungs, reverse=True)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("device", DEVICES)
def test_more_ranks_never_choose_a_costlier_setting(model: str, device: str) -> None:
    rungs = [rung(choose(model, device, w).layout) for w in WORLDS]
    assert rungs == sorted(rungs, reverse=True)


def test_a_1b_model_on_one_large_gpu_needs_neither_zero_3_nor_checkpointing() -> None:
    choice = choose("1B", "141GiB", 1)
    # Stage 1 moves the bytes plain data parallelism does; bf16 needs it for elastic checkpoints.
    assert (choice.layout.zero_stage, choice.layout.activation_checkpointing) == (1, False)
    assert choice.layout.offload_optimizer == "none"
    assert choice.layout.micro_batch_size >= 8  # 16k tokens or more per pass
    head, estimate = choice.lines()
    assert head.startswith("layout (auto) at world size 1: ZeRO-1, no offload, no activation checkpointing")
    assert "model states" in estimate and "activations" in estimate and "GiB usable on the device" in estimate


def test_a_7b_model_on_one_24_gib_gpu_offloads_its_optimizer() -> None:
    layout = choose("7B", "24GiB", 1).layout
    assert layout.offload_optimizer == "cpu" and layout.zero_stage >= 2


def test_a_70b_model_on_64_80_gib_gpus_shards_everything_and_checkpoints() -> None:
    layout = choose("70B", "80GiB", 64).layout
    assert (layout.zero_stage, layout.offload_optimizer, layout.activation_checkpointing) == (3, "none", True)


def test_a_70b_model_on_8_80_gib_gpus_offloads_the_optimizer_to_the_host() -> None:
    layout = choose("70B", "80GiB", 8).layout
    assert layout.zero_stage == 3 and layout.offload_optimizer == "cpu"


def test_nothing_fits_says_so_and_names_the_setting_needing_least() -> None:
    choice = choose("70B", "24GiB", 1, host=64 * GIB)
    assert not choice.fits
    assert "nothing fits" in choice.lines()[0]
    assert choice.layout.zero_stage == 3 and choice.layout.activation_checkpointing


def test_nvme_is_tried_only_where_a_path_is_set() -> None:
    without = choose("70B", "24GiB", 8, host=64 * GIB)
    with_nvme = choose("70B", "24GiB", 8, host=64 * GIB, nvme=True)
    assert "nvme" not in (without.layout.offload_optimizer, without.layout.offload_param)
    assert with_nvme.fits and with_nvme.layout.offload_optimizer == "nvme"


def test_the_users_values_win() -> None:
    layout = choose("1B", "141GiB", 1, {"zero_stage": 3, "micro_batch_size": 2}).layout
    assert (layout.zero_stage, layout.micro_batch_size) == (3, 2)
    assert not layout.activation_checkpointing  # still chosen: it fits without
    assert choose("1B", "141GiB", 1, {"activation_checkpointing": True}).layout.activation_checkpointing


def test_the_micro_batch_divides_each_replicas_share_of_the_global_batch() -> None:
    layout = choose("1B", "141GiB", 8, global_batch_size=8 * 12).layout
    assert 12 % layout.micro_batch_size == 0


def test_a_global_batch_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="global_batch_size=10 does not split over 4"):
        choose_layout(
            MODELS["1B"],
            Memory(0, 64 * GIB),
            world_size=4,
            data_parallel=4,
            global_batch_size=10,
            seq_len=512,
            precision="fp32",
            fixed={},
        )


def test_bf16_never_chooses_stage_0_and_fp32_may() -> None:
    assert all(choose(m, d, w).layout.zero_stage > 0 for m in MODELS for d in DEVICES for w in WORLDS)
    assert choose("1B", "141GiB", 1, precision="fp32").layout.zero_stage == 0


def test_on_cpu_the_host_share_is_the_only_memory() -> None:
    small = llama(256, 688, 2, 8, 8, 1000)
    choice = choose_layout(
        small,
        Memory(0, 8 * GIB),
        world_size=2,
        data_parallel=2,
        global_batch_size=24,
        seq_len=512,
        precision="fp32",
        fixed={},
    )
    assert choice.fits and choice.layout.zero_stage == 0 and choice.need.device == 0
    assert "usable on the host" in choice.lines()[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dims", [(256, 688, 8, 2, 1000), (384, 1024, 2, 3, 3000)])
def test_the_activation_estimate_matches_what_llama_keeps_for_backward(
    precision: str, checkpointing: bool, dims: tuple[int, int, int, int, int]
) -> None:
    """Every tensor autograd saves during a forward of transformers' Llama (SDPA), counted once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, kv_heads, layers, vocab = dims
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32 if precision == "fp32" else torch.bfloat16)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    ids = torch.randint(0, vocab, (2, 128))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(input_ids=ids, labels=ids)
    shape = llama(hidden, intermediate, layers, kv_heads, 8, vocab)
    estimate = kept_activation_bytes(shape, 2 * 128, precision, checkpointing)
    assert estimate == pytest.approx(sum(storages.values()), rel=0.12)


def test_a_lora_run_counts_its_frozen_weights_once_and_fits_where_full_training_would_not() -> None:
    full = MODELS["7B"]
    lora = ModelShape(**{**full.__dict__, "trainable": full.params // 100})
    memory = Memory(24 * GIB, HOST_PER_RANK)
    args = dict(world_size=1, data_parallel=1, global_batch_size=16, seq_len=2048, precision="bf16", fixed={})
    assert choose_layout(full, memory, **args).layout.offload_optimizer == "cpu"
    chosen = choose_layout(lora, memory, **args)
    assert chosen.layout.offload_optimizer == "none" and chosen.layout.zero_stage == 1
    assert chosen.need.states >= full.params * 2  # the bf16 base model stays on the device
