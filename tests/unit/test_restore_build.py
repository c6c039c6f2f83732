"""An attempt that loads its state builds the model without computing the random init the load
overwrites (at 1B under ZeRO-3 that init gathers and broadcasts 4 GB), but keeps everything a
checkpoint does not hold: buffers such as rotary frequencies, and tied weights.
"""

from __future__ import annotations

import torch

from elastictrain.compat.transformers.hf_init import skip_parameter_init
from elastictrain.model.build import build_causal_lm

LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}


def _restored(hf_config: dict, reference: torch.nn.Module) -> torch.nn.Module:
    with skip_parameter_init():
        model = build_causal_lm(hf_config)
    model.load_state_dict(reference.state_dict())
    return model


def test_a_model_built_for_restoring_and_then_loaded_computes_what_the_original_does():
    torch.manual_seed(0)
    reference = build_causal_lm(LLAMA).eval()
    restored = _restored(LLAMA, reference).eval()
    ids = torch.randint(0, 64, (2, 16))
    for name, buffer in reference.named_buffers():  # rotary inv_freq: in no state dict, still computed
        assert torch.equal(buffer, dict(restored.named_buffers())[name]), name
    assert torch.equal(reference(ids).logits, restored(ids).logits)


def test_building_for_restoring_skips_the_parameter_init_and_leaves_torch_init_as_it_was(monkeypatch):
    from transformers import initialization

    calls: list[str] = []

    def counting(name, function):  # noqa: ANN001, ANN202
        def wrapped(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls.append(name)
            return function(tensor, *args, **kwargs)

        return wrapped

    # Module constructors call torch.nn.init; transformers' _init_weights calls the originals it recorded.
    for name in ("normal_", "kaiming_uniform_"):
        monkeypatch.setattr(torch.nn.init, name, counting(name, getattr(torch.nn.init, name)))
        recorded = initialization.TORCH_INIT_FUNCTIONS
        monkeypatch.setitem(recorded, name, counting(name, recorded[name]))
    build_causal_lm(LLAMA)
    assert {"normal_", "kaiming_uniform_"} <= set(calls), "an ordinary build initialises parameters"
    calls.clear()
    patched = torch.nn.init.normal_
    with skip_parameter_init():
        build_causal_lm(LLAMA)
    assert calls == []
    assert torch.nn.init.normal_ is patched  # put back as it was found


def test_a_model_with_tied_embeddings_built_for_restoring_keeps_them_tied():
    with skip_parameter_init():
        model = build_causal_lm(GPT2)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_skipping_the_init_on_one_thread_leaves_other_threads_building_as_usual_and_is_undone_in_any_order():
    """Two threads enter, and leave in the order that made a save-and-put-back patch stay for good;
    meanwhile a third builds a model as usual: its weights are transformers' init, not left as allocated."""
    import threading

    from transformers.modeling_utils import PreTrainedModel

    originals = (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_, PreTrainedModel._initialize_weights)
    a_inside, b_inside, a_may_leave, b_may_leave = (threading.Event() for _ in range(4))
    errors: list[BaseException] = []

    def skipping(inside: threading.Event, may_leave: threading.Event) -> None:
        try:
            with skip_parameter_init():
                inside.set()
                assert may_leave.wait(30)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    a = threading.Thread(target=skipping, args=(a_inside, a_may_leave))
    b = threading.Thread(target=skipping, args=(b_inside, b_may_leave))
    a.start()
    assert a_inside.wait(30)
    b.start()
    assert b_inside.wait(30)
    torch.manual_seed(0)
    built_beside = build_causal_lm(LLAMA)  # this thread is in no block: an ordinary build
    torch.manual_seed(0)
    a_may_leave.set()  # A (which entered first) leaves first: B put back what it found, A's no-ops
    a.join(30)
    b_may_leave.set()
    b.join(30)
    assert not errors, errors
    now = (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_, PreTrainedModel._initialize_weights)
    assert now == originals, "every function put back as it was before either thread entered"
    alone = build_causal_lm(LLAMA)
    for (name, p), q in zip(built_beside.named_parameters(), alone.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: not initialised as a build alone initialises it"
