"""Pipeline layouts: whole replicas of P stages read one micro-batch each, the config says what a layout
needs and refuses by name what the stages cannot run, and checkpoints name a stage's parameters as
transformers does."""

from __future__ import annotations

import pytest
import torch

from elastictrain.config import ConfigError, load_config, valid_world_sizes
from elastictrain.config.deepspeed_config import build_deepspeed_config
from elastictrain.core.batch import plan_batch
from elastictrain.core.data_order import micro_batch_positions
from elastictrain.core.losses import replica_results, step_loss
from elastictrain.core.policy import ScalingRules
from elastictrain.model.pipeline import Norm, hf_name, layer_module, module_hf_name, stage_layers

PIPELINE = ["deepspeed.zero_stage=1", "scaling.pipeline_parallel=2"]


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*PIPELINE, *overrides])
    return str(e.value)


def test_a_replica_is_its_stages_and_they_read_the_same_micro_batches():
    plan = plan_batch(24, 4, 4, pipeline_parallel=2)
    assert plan is not None
    assert (plan.replica_ranks, plan.data_parallel, plan.micro_batch_size, plan.grad_accum_steps) == (
        2,
        2,
        4,
        3,
    )
    assert [plan.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    for micro in range(plan.grad_accum_steps):
        assert list(micro_batch_positions(5, plan, 1, micro)) == list(
            micro_batch_positions(5, plan, 0, micro)
        )
    assert plan_batch(24, 4, 3, pipeline_parallel=2) is None  # 3 ranks: no whole replicas of 2


def test_world_sizes_are_whole_replicas_of_stages():
    rules = ScalingRules(2, 6, 12, 2, 3, 10.0, pipeline_parallel=2)
    assert rules.best_size(5) == 4 and rules.best_size(6) == 6 and rules.best_size(1) is None
    cfg = load_config(None, [*PIPELINE, "scaling.min_workers=2", "scaling.max_workers=6"])
    assert valid_world_sizes(cfg) == [2, 4, 6]


def test_a_stage_reports_its_replicas_loss_once():
    results = [
        {"rank": r, "replica_ranks": 2, "loss": 2.0, "loss_sum": 20.0 * (1 + r // 2), "target_tokens": 10}
        for r in range(4)
    ]
    assert [r["rank"] for r in replica_results(results)] == [0, 2]
    assert step_loss(replica_results(results)) == pytest.approx(1.5 * 20.0 / 10)


def test_the_deepspeed_config_leaves_the_batch_size_to_deepspeed_at_both_readings():
    cfg = load_config(None, [*PIPELINE, "scaling.min_workers=4", "scaling.max_workers=4"])
    ds = build_deepspeed_config(cfg, 4, 3, 2, pipeline_parallel=2)
    assert "train_batch_size" not in ds
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 3)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["deepspeed.zero_stage=3"], "deepspeed.zero_stage: got 3 with scaling.pipeline_parallel 2"),
        (["scaling.min_workers=3", "scaling.max_workers=3"], "scaling.min_workers: got 3"),
        (
            ["scaling.tensor_parallel=2", "scaling.min_workers=4", "scaling.max_workers=4"],
            "scaling.tensor_parallel",
        ),
        (["model.hf_config.model_type=gpt2"], "model.hf_config.model_type: got 'gpt2'"),
        (
            [
                "model.hf_config.num_hidden_layers=1",
                "scaling.pipeline_parallel=4",
                "scaling.max_workers=4",
                "scaling.min_workers=4",
            ],
            "at most 3 stages",
        ),
        (["model.lora.enabled=true", "model.lora.use_dora=true"], "model.lora.use_dora: got True"),
        (["model.lora.enabled=true", 'model.lora.modules_to_save=["lm_head"]'], "model.lora.modules_to_save"),
        (
            ["model.lora.enabled=true", 'model.lora.target_modules=["q_proj","embed_tokens"]'],
            "model.lora.target_modules: ['embed_tokens']",
        ),
        (
            [
                "model.lora.enabled=true",
                "model.hf_config.num_hidden_layers=2",
                "scaling.pipeline_parallel=3",
                "scaling.max_workers=3",
                "scaling.min_workers=3",
            ],
            "with LoRA; a stage needs a decoder layer's adapters to train and the model has 2",
        ),
        (["training.objective=dpo"], "training.objective: got 'dpo'"),
        (["deepspeed.offload_optimizer=cpu"], "deepspeed.offload_optimizer: got 'cpu'"),
        (["deepspeed.activation_checkpointing=true"], "deepspeed.activation_checkpointing"),
        (["scaling.pipeline_parallel=0"], "scaling.pipeline_parallel: got 0"),
    ],
)
def test_what_pipeline_stages_cannot_run_is_refused_naming_the_field(overrides, expected):
    assert expected in problems(*overrides)


def test_one_stage_is_no_pipeline_and_refuses_nothing():
    cfg = load_config(None, ["scaling.pipeline_parallel=1", "deepspeed.zero_stage=3"])
    assert cfg.scaling.pipeline_parallel == 1


def test_a_stage_names_parameters_as_transformers_does():
    # Layers: the embedding, two decoder layers, the norm and head (tied: the norm, then the embedding).
    assert hf_name(0, "embed_tokens.weight") == "model.embed_tokens.weight"
    assert hf_name(2, "layer.self_attn.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert hf_name(3, "norm.weight") == "model.norm.weight"
    assert hf_name(3, "lm_head.weight") == "lm_head.weight"
    assert module_hf_name("3.lm_head.weight") == "lm_head.weight"
    assert module_hf_name("tied_modules.embed.embed_tokens.weight") == "model.embed_tokens.weight"


def test_tied_embeddings_are_one_tied_layer_at_both_ends_and_the_norm_a_layer_of_its_own():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    layers = stage_layers(model)
    assert len(layers) == 5  # embedding, 2 decoders, norm, tied head
    first, last = layers[0], layers[-1]
    assert first.key == last.key and layer_module(first) is layer_module(last)
    assert layer_module(last).embed_tokens.weight is model.lm_head.weight  # the model's own tie
    assert isinstance(layers[3], Norm) and layers[3].norm is model.model.norm
    hidden = torch.randn(1, 3, 16)
    assert torch.equal(last.forward_fn(layer_module(last), hidden), model.lm_head(hidden))


def test_a_pipeline_replica_takes_whole_nodes_first_then_spans_the_fewest_nodes_left():
    from elastictrain.core.replicas import nodes_per_replica, pipeline_order

    # Preference order (survivors first): a, b, a, c, b, b. Stages 2: a's pair and b's pair are whole
    # replicas on one node; c's one worker and b's third form the last replica across two nodes.
    nodes = ["a", "b", "a", "c", "b", "b"]
    order = pipeline_order(nodes, 6, 2)
    assert order == [0, 2, 1, 4, 5, 3]
    assert nodes_per_replica([nodes[i] for i in order], 2) == [1, 1, 2]
    # Nodes of one slot each: every replica of 3 stages spans 3 nodes, in preference order.
    assert pipeline_order(["a", "b", "c"], 3, 3) == [0, 1, 2]
    # Only the first `size` preferred workers take part; fewer listed, fewer returned.
    assert pipeline_order(["a", "b", "a", "b"], 2, 2) == [0, 1]
    assert pipeline_order(["a"], 2, 2) == [0]
    # The node with most workers left goes first, so the rest pack onto as few nodes as they can.
    assert nodes_per_replica([n for n in "abbccc"], 3) == [2, 1]
    nodes = ["a", "b", "b", "c", "c", "c"]
    assert nodes_per_replica([nodes[i] for i in pipeline_order(nodes, 6, 3)], 3) == [1, 2]


def test_a_pipeline_attempt_forms_replicas_across_nodes_where_a_tensor_parallel_one_would_not():
    from elastictrain.core.replicas import attempt_workers

    warm = ["w0", "w1", "w2"]
    node = {"w0": "a", "w1": "b", "w2": "c"}.__getitem__
    assert attempt_workers([], warm, 2, 2, node) == []  # tensor-parallel ranks need one node
    assert attempt_workers([], warm, 2, 1, node, pipeline_stages=2) == ["w0", "w1"]


def _tiny_llama(tied: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


def test_lora_adapters_start_the_same_whoever_builds_them_and_stages_hold_a_frozen_tied_head_apart():
    """A whole model and the stages of a meta-built one give each adapter the same first values (drawn
    by the run's seed and the layer's name, not in the order peft wraps layers); LoRA's frozen tied
    embedding is no tied layer: the last stage's head holds the embedding itself."""
    from elastictrain.model.lora import apply_lora, init_adapters

    lora = load_config(None, ["model.lora.enabled=true", "model.lora.target_modules=all-linear"]).model.lora
    torch.manual_seed(0)
    whole = apply_lora(_tiny_llama(tied=True), lora, seed=7)
    torch.manual_seed(1)  # other draws before: the same adapters
    again = apply_lora(_tiny_llama(tied=True), lora, seed=7)
    a = {n: p for n, p in whole.named_parameters() if "lora_A" in n}
    assert len(a) == 14 and all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in a.items())
    assert all(torch.count_nonzero(p) == 0 for n, p in whole.named_parameters() if "lora_B" in n)

    with torch.device("meta"):
        meta = _tiny_llama(tied=True)
    layers = stage_layers(apply_lora(meta, lora))
    assert [type(layer_module(x)).__name__ for x in layers] == ["Embed", "Decoder", "Decoder", "Head"]
    staged = {}
    for i, layer in enumerate(layers):
        module = layer_module(layer)
        for name, child in module.named_children():
            if name != "rotary":
                child.to_empty(device="cpu")
        init_adapters(((hf_name(i, n), m) for n, m in module.named_modules() if n), seed=7)
        staged |= {
            "base_model.model." + hf_name(i, n): p for n, p in module.named_parameters() if "lora_A" in n
        }
    assert staged.keys() == a.keys() and all(torch.equal(staged[n], p) for n, p in a.items())
