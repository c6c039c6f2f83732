"""The run's model: your `model.factory`, a transformers model from a local folder, or one from a config.

Whatever the source, the model is built inside DeepSpeed's zero.Init (parameters partitioned as they
are created) with transformers' own weight initialization (compat/transformers/hf_init.py), optionally wrapped
with LoRA adapters (model/lora.py), and trained with a loss
`loss(model, batch) -> scalar tensor`: yours (`training.loss`) or the causal LM loss below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from elastictrain.compat.deepspeed.zero3_build import (
    fp32_masters_left_for_the_load,
    freed_partitions_returned,
    hooks_registered_without_gathering,
    optimizer_states_initialized_without_swapping,
)
from elastictrain.compat.deepspeed.zero3_memory import (
    create_swapped_adam_state,
    share_fp32_partitions,
    share_offloaded_gradients,
)
from elastictrain.host.memory import release_freed_memory

# transformers' ZeRO-3 loading of a pretrained folder finds the DeepSpeed config through a weak
# reference to this object; it must stay alive while that model is built and trained.
_hf_ds_config: Any = None


def build_hf_config(hf_config: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    params = dict(hf_config)
    model_type = params.pop("model_type")
    return AutoConfig.for_model(model_type, **params)


def preload_model_code(config: Any) -> None:
    """Import everything building the model will import, outside of DeepSpeed's zero.Init."""
    import torch._dynamo  # noqa: F401
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    m = config.model
    if m.factory:
        from elastictrain.user_code import resolve

        resolve(config, "model.factory")  # imports the user's module
    else:
        hf = AutoConfig.from_pretrained(m.pretrained) if m.pretrained else build_hf_config(dict(m.hf_config))
        MODEL_FOR_CAUSAL_LM_MAPPING[type(hf)]  # imports the lazy model module, outside zero.Init
    if m.lora.enabled:
        import peft  # noqa: F401


def preload_engine_code(config: Any) -> None:
    """Pay what a rank's first `deepspeed.initialize` pays once per process, so a new actor pays it
    while warming up rather than on a replacement's critical path.

    DeepSpeed's optimizer check imports its Muon optimizer; an offloaded optimizer loads DeepSpeed's
    CPU Adam op, and NVMe its async I/O op, each asking py-cpuinfo about the CPU
    (compat/deepspeed/cpu_info.py).
    """
    import importlib

    from elastictrain.compat.deepspeed.ops import load_op
    from elastictrain.config.deepspeed_config import effective_offload

    with contextlib.suppress(ImportError):  # a DeepSpeed without it does not import it either
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
    offloads = effective_offload(config)
    ops = ["CPUAdamBuilder"] if offloads[0] != "none" else []
    ops += ["AsyncIOBuilder"] if "nvme" in offloads else []
    for name in ops:
        # A missing or broken op is the engine build's to report, with DeepSpeed's own message.
        with contextlib.suppress(Exception):
            load_op(name)


def attention_kernel(config: Any) -> str | None:
    """model.attn_implementation for transformers (None: its default, sdpa where the model has it)."""
    import importlib.util

    chosen = str(config.model.attn_implementation)
    if chosen != "auto":
        return chosen
    half = config.training.precision in ("bf16", "fp16")
    if config.scaling.use_gpu and half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


def build_causal_lm(
    hf_config: dict[str, Any], *, activation_checkpointing: bool = False, attention: str | None = None
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = build_hf_config(hf_config)
    kernel = {"attn_implementation": attention} if attention else {}
    model = AutoModelForCausalLM.from_config(config, **kernel)
    if activation_checkpointing:
        _enable_checkpointing(model)
    return model


def _enable_checkpointing(model: Any) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


def build_model(
    config: Any, ds_config: dict[str, Any], *, zero3: bool, restoring: bool = False
) -> torch.nn.Module:
    """The model of `config.model`, its parameters partitioned by ZeRO-3 as they are created.

    `restoring`: the attempt loads every parameter from a checkpoint or a snapshot next, so a built-in
    model skips computing its random init (a user's model code and LoRA's frozen base still run theirs).
    """
    import deepspeed

    # A previous attempt's pretrained model must not change how this one initialises its weights.
    forget_hf_deepspeed_config()
    m = config.model
    checkpointing = config.deepspeed.activation_checkpointing
    attention = attention_kernel(config)
    if m.pretrained:
        model = _from_pretrained(m.pretrained, ds_config, zero3=zero3, attention=attention)
        if checkpointing:
            _enable_checkpointing(model)
    else:
        from elastictrain.compat.deepspeed.zero3_build import parameters_partitioned_without_broadcast
        from elastictrain.compat.transformers.hf_init import exact_hf_init_under_zero3, skip_parameter_init

        # zero.Init partitions each module as it is built; without the second context transformers'
        # own weight init would write into empty partitions and be lost (compat/transformers/hf_init.py).
        init = contextlib.ExitStack()
        if restoring and not m.factory and not m.lora.enabled:
            # Every parameter is loaded next: no init to be exact about, no values to make equal.
            init.enter_context(skip_parameter_init())
            if zero3:
                init.enter_context(parameters_partitioned_without_broadcast())
        elif zero3:
            init.enter_context(exact_hf_init_under_zero3())
        with init, deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=zero3):
            if m.factory:
                from elastictrain.user_code import user_model

                model = user_model(config)
                if checkpointing:
                    _enable_checkpointing(model)  # checked on the driver: the model has the method
            else:
                model = build_causal_lm(
                    dict(m.hf_config), activation_checkpointing=checkpointing, attention=attention
                )
    if m.lora.enabled:
        from elastictrain.model.lora import apply_lora

        model = apply_lora(model, m.lora, seed=config.training.seed, activation_checkpointing=checkpointing)
    if config.training.objective != "lm":
        from elastictrain.model.objective import disable_dropout

        disable_dropout(model)
    return model


def new_engine(spec: Any, *, zero3: bool) -> Any:
    """The attempt's DeepSpeed engine around a newly built model (`spec`: worker.attempt.AttemptSpec)."""
    import os

    import deepspeed

    from elastictrain.compat.deepspeed.cpu_info import remember_cpu_info
    from elastictrain.config.deepspeed_config import nvme_paths

    cfg = spec.config
    remember_cpu_info()  # probed once per process (a warmed-up actor did it loading its ops)
    torch.manual_seed(cfg.training.seed)  # identical random init on every rank
    # zero.Init patches tensor construction; lazy imports inside it (torch._dynamo) then fail.
    preload_model_code(cfg)
    for folder in nvme_paths(spec.ds_config):
        os.makedirs(folder, exist_ok=True)
    restoring = spec.memory is not None or spec.checkpoint_dir is not None
    lora = cfg.model.lora.enabled
    # LoRA's frozen base is not in checkpoints: without a pretrained folder every rank rebuilds it whole.
    if spec.plan.pipeline_parallel > 1 and (cfg.model.pretrained or (restoring and not lora)):
        model = _on_meta(cfg)  # each stage makes only its own layers real (model/pipeline.py)
        if lora:
            from elastictrain.model.lora import apply_lora

            model = apply_lora(model, cfg.model.lora)  # the stage's adapters get their values as it does
    else:
        model = build_model(cfg, spec.ds_config, zero3=zero3, restoring=restoring)
    # The model's build frees pieces (whole parameters before partitioning, their init) that the
    # engine's large buffers, allocated next, cannot reuse: the workers' malloc would keep both.
    release_freed_memory()
    with (
        hooks_registered_without_gathering(),
        optimizer_states_initialized_without_swapping(),
        freed_partitions_returned(),
        fp32_masters_left_for_the_load() if restoring else contextlib.nullcontext(),
    ):
        if spec.plan.pipeline_parallel > 1:
            from elastictrain.model.pipeline import new_pipeline_engine

            return new_pipeline_engine(spec, model)
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=spec.ds_config,
        )
    from elastictrain.compat.deepspeed.skip_update import skip_non_finite_updates

    skip_non_finite_updates(engine)  # DeepSpeed's own optimizers skip such steps; torch's would not
    if cfg.model.compile:
        engine.compile()  # torch.compile with the accelerator's backend; compiles on the first steps
    if zero3:
        share_fp32_partitions(engine)
        share_offloaded_gradients(engine, cpu_only=not cfg.scaling.use_gpu)
        if not restoring:  # a restoring build's loader creates the state as it fills it
            create_swapped_adam_state(engine)
    return engine


def _on_meta(config: Any) -> torch.nn.Module:
    """The transformers model of `config.model` with no memory behind its weights (the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = config.model
    hf = AutoConfig.from_pretrained(m.pretrained, local_files_only=True) if m.pretrained else None
    hf = hf or build_hf_config(dict(m.hf_config))
    attention = attention_kernel(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            hf, **({"attn_implementation": attention} if attention else {})
        )


def forget_hf_deepspeed_config() -> None:
    """Stop transformers from treating models built next as ZeRO-3 ones (it builds them under zero.Init)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    global _hf_ds_config
    _hf_ds_config = None
    unset_hf_deepspeed_config()


def _from_pretrained(
    folder: str, ds_config: dict[str, Any], *, zero3: bool, attention: str | None = None
) -> torch.nn.Module:
    """Load a local transformers folder; under ZeRO-3 each rank keeps only its partition of the weights."""
    global _hf_ds_config
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    if zero3:
        _hf_ds_config = HfDeepSpeedConfig(ds_config)
    kernel = {"attn_implementation": attention} if attention else {}
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kernel)


def causal_lm_loss(model: Any, batch: Any) -> torch.Tensor:
    """The default loss: next-token cross entropy of a transformers causal LM.

    A tensor batch is token ids (labels = the ids); a dict batch is passed as keyword arguments, with
    labels = input_ids unless it holds labels (e.g. -100 on padding).
    """
    if isinstance(batch, Mapping):
        kwargs = dict(batch)
        kwargs.setdefault("labels", kwargs.get("input_ids"))
    else:
        kwargs = {"input_ids": batch, "labels": batch}
    out = model(**kwargs)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "training.loss: not set, and the model's output has no `loss`; give training.loss as "
            "'module:attr' (or loss= to elastictrain.fit), a function loss(model, batch) -> scalar tensor"
        )
    return loss


def loss_function(config: Any) -> Any:
    """training.loss, else the preference objective (model/objective.py), else the causal LM loss."""
    from elastictrain.model.objective import PreferenceObjective
    from elastictrain.user_code import user_callable

    return user_callable(config, "training.loss") or PreferenceObjective.from_config(config) or causal_lm_loss
