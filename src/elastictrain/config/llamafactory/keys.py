"""Every LLaMA-Factory training key elastictrain reads: what it becomes, has no effect, or is refused.

One row a key, with LLaMA-Factory's default (its own, else transformers' TrainingArguments'), applied
when the key is not given, so a file means the same training in both. A mapped key's `apply` writes
elastictrain keys into the Reading; a refused key is refused only when given a value other than its
default (a file saying `quantization_bit: null` is fine). docs/reference/llamafactory-keys.md is
generated from this table (`make docs-reference`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import elastictrain.config.llamafactory.convert as c
from elastictrain.config.llamafactory.reading import Reading

MAPPED, NO_EFFECT, REFUSED = "mapped", "no effect", "refused"


@dataclass(frozen=True)
class Key:
    name: str
    default: Any
    kind: str  # MAPPED | NO_EFFECT | REFUSED
    becomes: str = ""  # the elastictrain key(s) it becomes (MAPPED), for the table
    note: str = ""  # MAPPED: what differs or is worth knowing; else why it has no effect / is refused
    apply: Callable[[Any, Reading], None] | None = None


_M = MAPPED
_NOT_HERE = "the run is launched by elastictrain on Ray"
KEYS: tuple[Key, ...] = (
    # --- model
    Key(
        "model_name_or_path",
        None,
        _M,
        "model.pretrained",
        "a folder, or a hub id read from the local "
        "Hugging Face cache (nothing is downloaded); stage pt: also data.tokenizer",
    ),
    Key("model_revision", "main", _M, "(the cached snapshot)", "which snapshot of a hub id is read"),
    Key(
        "cache_dir",
        None,
        _M,
        "(the cache searched)",
        "where hub ids are looked up (else HF_HUB_CACHE, HF_HOME)",
    ),
    Key(
        "adapter_name_or_path",
        None,
        REFUSED,
        note="training on from a saved adapter: continue an elastictrain "
        "LoRA run with `elastictrain resume RUN_DIR`; `elastictrain export -c` reads it to merge",
    ),
    Key(
        "trust_remote_code",
        False,
        NO_EFFECT,
        note="models load with transformers' own classes; a model that "
        "needs its repository's code fails to load, naming it",
    ),
    Key(
        "use_fast_tokenizer",
        True,
        NO_EFFECT,
        note="the tokenizer's own class (its fast one where it has one)",
    ),
    Key("split_special_tokens", False, REFUSED, note="special tokens are kept whole"),
    Key("resize_vocab", False, REFUSED, note="add the tokens to the tokenizer and model folder first"),
    Key("new_special_tokens", None, REFUSED, note="add the tokens to the tokenizer and model folder first"),
    Key("low_cpu_mem_usage", True, NO_EFFECT, note="weights load straight into each rank's shard"),
    Key("flash_attn", "auto", NO_EFFECT, note="transformers' default attention of the model (sdpa)"),
    Key("rope_scaling", None, REFUSED, note="write rope_scaling into the model folder's config.json"),
    Key("shift_attn", False, REFUSED, note="S^2-Attn is not supported"),
    Key("mixture_of_depths", None, REFUSED, note="not supported"),
    Key("use_unsloth", False, REFUSED, note="unsloth's kernels are not supported (DeepSpeed runs the model)"),
    Key("use_unsloth_gc", False, REFUSED, note="unsloth's kernels are not supported"),
    Key(
        "enable_liger_kernel",
        False,
        NO_EFFECT,
        note="transformers' own kernels run: the same numbers, without Liger's speed and memory savings",
    ),
    Key("use_liger_kernel", False, NO_EFFECT, note="as enable_liger_kernel"),
    Key(
        "disable_gradient_checkpointing",
        False,
        _M,
        "deepspeed.activation_checkpointing",
        "on unless disabled, as in LLaMA-Factory",
        lambda v, r: r.set("deepspeed.activation_checkpointing", not v),
    ),
    Key("use_reentrant_gc", True, NO_EFFECT, note="transformers' checkpointing as the model enables it"),
    Key("upcast_layernorm", False, REFUSED, note="not supported"),
    Key("upcast_lmhead_output", False, NO_EFFECT, note="the loss is computed in fp32 already"),
    Key(
        "train_from_scratch",
        False,
        REFUSED,
        note="give model.hf_config (a config, randomly initialized) in elastictrain's own form",
    ),
    Key("print_param_status", False, NO_EFFECT, note="the start line counts trainable parameters"),
    Key("use_cache", True, NO_EFFECT, note="the KV cache is off while training"),
    Key("infer_dtype", "auto", NO_EFFECT, note="for inference"),
    Key("infer_backend", "huggingface", NO_EFFECT, note="for inference"),
    Key("hf_hub_token", None, NO_EFFECT, note="nothing is downloaded"),
    Key("ms_hub_token", None, NO_EFFECT, note="nothing is downloaded"),
    Key("om_hub_token", None, NO_EFFECT, note="nothing is downloaded"),
    Key("quantization_bit", None, REFUSED, note="QLoRA is not supported: LoRA on the unquantized model"),
    Key("quantization_method", "bnb", NO_EFFECT, note="no quantization (quantization_bit is refused)"),
    Key(
        "moe_aux_loss_coef", None, REFUSED, note="set router_aux_loss_coef in the model folder's config.json"
    ),
    # --- method
    Key(
        "stage",
        "sft",
        _M,
        "data.source, training.objective",
        "sft: instruction records (data.source sft); pt: plain text (data.source hf, packed); dpo, kto: "
        "preference records (data.source sft; training.objective from pref_loss, or kto); rm and ppo are "
        "refused",
    ),
    Key(
        "do_train", False, _M, "(required)", "must be true: it is what `elastictrain train` does", c.do_train
    ),
    Key("do_eval", False, NO_EFFECT, note="validation is set by eval.* (val_size is refused)"),
    Key("do_predict", False, REFUSED, note="`elastictrain eval RUN_DIR` evaluates a run"),
    Key("finetuning_type", "lora", _M, "model.lora.enabled", "lora or full", c.finetuning),
    Key("lora_rank", 8, _M, "model.lora.r", apply=c.to("model.lora.r")),
    Key("lora_alpha", None, _M, "model.lora.alpha", "default twice lora_rank", c.lora_alpha),
    Key(
        "lora_dropout",
        0.0,
        _M,
        "model.lora.dropout",
        "0 at stage dpo and kto, which LLaMA-Factory trains with dropout off",
        c.lora_dropout,
    ),
    Key(
        "lora_target",
        "all",
        _M,
        "model.lora.target_modules",
        "all: every linear layer but the output head (all-linear); else the names",
        c.lora_target,
    ),
    Key("additional_target", None, _M, "model.lora.modules_to_save", apply=c.modules_to_save),
    Key("use_rslora", False, _M, "model.lora.use_rslora", apply=c.to("model.lora.use_rslora")),
    Key("use_dora", False, _M, "model.lora.use_dora", apply=c.to("model.lora.use_dora")),
    Key("loraplus_lr_ratio", None, REFUSED, note="LoRA+ is not supported"),
    Key("pissa_init", False, REFUSED, note="PiSSA is not supported"),
    Key("create_new_adapter", False, NO_EFFECT, note="a LoRA run creates its adapter"),
    Key(
        "deepspeed",
        None,
        _M,
        "deepspeed.config_file, deepspeed.zero_stage",
        'used unchanged ("auto" filled in); none given: ZeRO stage 1 (the update DDP computes, the '
        "optimizer state split between ranks)",
    ),
    Key(
        "plot_loss",
        False,
        _M,
        "tracking.plots",
        "PNGs of every metric in RUN_DIR/plots",
        c.to("tracking.plots"),
    ),
    # --- preference training (stage dpo, kto; read at those stages only)
    Key(
        "pref_loss",
        "sigmoid",
        _M,
        "training.objective, preference.dpo_loss",
        "sigmoid, hinge, ipo: objective dpo with that dpo_loss; orpo, simpo: that objective (kto_pair and "
        "others are refused)",
        c.preference,
    ),
    Key("pref_beta", 0.1, _M, "preference.beta", "every objective's beta"),
    Key(
        "pref_ftx",
        0.0,
        _M,
        "preference.ftx",
        "every objective (orpo: beside its own NLL term; stage kto: on desirable answers)",
    ),
    Key(
        "dpo_label_smoothing",
        0.0,
        _M,
        "preference.label_smoothing",
        "pref_loss sigmoid only (as LLaMA-Factory checks)",
    ),
    Key("simpo_gamma", 0.5, _M, "preference.simpo_gamma", "pref_loss simpo"),
    Key("kto_chosen_weight", 1.0, _M, "preference.kto_desirable_weight", "stage kto"),
    Key("kto_rejected_weight", 1.0, _M, "preference.kto_undesirable_weight", "stage kto"),
    Key(
        "ref_model",
        None,
        _M,
        "(the starting model: preference.reference)",
        "unset or model_name_or_path: the starting model is the reference (LoRA: its adapters off; "
        "full: log-probabilities computed before the first step); another model is refused",
        c.reference,
    ),
    Key("ref_model_adapters", None, _M, "(with ref_model: refused)", "a reference with adapters is refused"),
    Key(
        "ref_model_quantization_bit",
        None,
        _M,
        "(with ref_model: refused)",
        "a quantized reference is refused",
    ),
    Key("pref_bco_weight", 0.0, REFUSED, note="BCO (Binary Classifier Optimization); leave it 0"),
    Key(
        "ld_alpha",
        None,
        REFUSED,
        note="LD-DPO (the longer answer's tokens past the shorter's length weighted by ld_alpha); "
        "leave it out",
    ),
    # --- data
    Key("dataset", None, _M, "data.dataset", "names in dataset_dir's dataset_info.json"),
    Key("dataset_dir", "data", _M, "data.dataset_dir", "relative to the working directory"),
    Key(
        "eval_dataset", None, REFUSED, note="give eval.data.dataset=NAME (with eval.steps, eval.every_steps)"
    ),
    Key(
        "template",
        None,
        _M,
        "(the tokenizer's own chat template)",
        "checked against LLaMA-Factory's names (the start says what differs); data.template=FILE for another",
    ),
    Key("cutoff_len", 2048, _M, "data.seq_len", "a record's end is cut, its prompt kept first", c.cutoff),
    Key(
        "train_on_prompt",
        False,
        _M,
        "data.train_on_prompt",
        "no effect at stage dpo and kto (answers only)",
        c.answer_only("train_on_prompt"),
    ),
    Key(
        "mask_history",
        False,
        _M,
        "data.mask_history",
        "no effect at stage dpo and kto (answers only)",
        c.answer_only("mask_history"),
    ),
    Key(
        "max_samples",
        None,
        _M,
        "data.max_samples",
        "the first N records of each dataset",
        c.to("data.max_samples"),
    ),
    Key(
        "packing",
        None,
        _M,
        "data.packing",
        "default: true for stage pt, false otherwise (never at stage dpo, kto); packed records "
        "never attend to each other (LLaMA-Factory's neat_packing)",
        c.packing,
    ),
    Key("neat_packing", False, _M, "data.packing", "as packing: true"),
    Key(
        "default_system",
        None,
        _M,
        "data.system",
        "else the template's default system prompt, if any",
        c.system,
    ),
    Key(
        "tool_format",
        None,
        _M,
        "data.tool_format",
        "qwen; none: the model's own chat template renders tools and calls (refused where it drops them)",
        c.tool_format,
    ),
    Key("enable_thinking", True, NO_EFFECT, note="the model's own template renders reasoning as it does"),
    Key(
        "streaming",
        False,
        REFUSED,
        note="records are read into memory once; for large corpora use "
        "`elastictrain prepare-data` and data.source tokens",
    ),
    Key("buffer_size", 16384, NO_EFFECT, note="only with streaming"),
    Key("mix_strategy", "concat", _M, "(order named)", "concat only", c.mix),
    Key("interleave_probs", None, REFUSED, note="datasets are trained on in the order named"),
    Key("overwrite_cache", False, NO_EFFECT, note="records are tokenized at every start (no cache)"),
    Key("preprocessing_batch_size", 1000, NO_EFFECT, note="records are tokenized in batches of 512"),
    Key("preprocessing_num_workers", None, NO_EFFECT, note="records are tokenized on the driver"),
    Key("ignore_pad_token_for_loss", True, NO_EFFECT, note="padding is never trained"),
    Key(
        "val_size",
        0.0,
        _M,
        "(refused when > 0)",
        "use eval.split, eval.steps, eval.every_steps",
        c.eval_split,
    ),
    Key("eval_on_each_dataset", False, NO_EFFECT, note="validation is set by eval.*"),
    Key(
        "tokenized_path",
        None,
        REFUSED,
        note="records are tokenized at start; for large corpora use "
        "`elastictrain prepare-data` and data.source tokens",
    ),
    Key("data_shared_file_system", False, NO_EFFECT, note="records are read on the driver"),
    Key("media_dir", None, NO_EFFECT, note="text data only"),
    # --- training (transformers' TrainingArguments)
    Key("output_dir", None, _M, "run.dir, run.name", "the run folder, relative to the working directory"),
    Key(
        "overwrite_output_dir",
        False,
        _M,
        "(train --fresh)",
        "true: a run already in output_dir is moved "
        "aside (kept) and training starts over; false: the run there is continued",
    ),
    Key(
        "resume_from_checkpoint",
        None,
        REFUSED,
        note="continue a run from its folder: `elastictrain resume OUTPUT_DIR` (or train with "
        "overwrite_output_dir: false); a Trainer checkpoint-N folder does not load",
    ),
    Key(
        "save_only_model",
        False,
        NO_EFFECT,
        note="checkpoints keep the optimizer state, which resuming at any "
        "world size needs; `elastictrain export` writes the model alone",
    ),
    Key(
        "per_device_train_batch_size",
        8,
        _M,
        "training.micro_batch_size, training.global_batch_size",
        "global batch = per device x gradient_accumulation_steps x the starting world size, fixed at every "
        "world size",
    ),
    Key(
        "gradient_accumulation_steps", 1, _M, "training.global_batch_size", "see per_device_train_batch_size"
    ),
    Key("learning_rate", 5e-5, _M, "training.lr", apply=c.to("training.lr")),
    Key(
        "num_train_epochs",
        3.0,
        _M,
        "training.num_epochs",
        "steps = ceil(epochs x records / global batch)",
        c.length,
    ),
    Key("max_steps", -1, _M, "training.max_steps", "> 0: replaces num_train_epochs"),
    Key(
        "lr_scheduler_type",
        "linear",
        _M,
        "training.lr_schedule, training.min_lr",
        "linear, cosine, constant, "
        "constant_with_warmup, cosine_with_min_lr; decays end at 0 as transformers' do",
        c.schedule,
    ),
    Key("lr_scheduler_kwargs", None, _M, "training.min_lr", "min_lr or min_lr_rate of cosine_with_min_lr"),
    Key("warmup_ratio", 0.0, _M, "training.warmup_ratio", "ceil(ratio x steps)", c.warmup),
    Key("warmup_steps", 0, _M, "training.warmup_steps", "wins over warmup_ratio; below 1: a ratio"),
    Key("weight_decay", 0.0, _M, "training.weight_decay", apply=c.to("training.weight_decay")),
    Key("adam_beta1", 0.9, _M, "training.adam_beta1", apply=c.to("training.adam_beta1")),
    Key("adam_beta2", 0.999, _M, "training.adam_beta2", apply=c.to("training.adam_beta2")),
    Key("adam_epsilon", 1e-8, _M, "training.adam_eps", apply=c.to("training.adam_eps")),
    Key("max_grad_norm", 1.0, _M, "training.grad_clip", apply=c.to("training.grad_clip")),
    Key("optim", "adamw_torch", _M, "(AdamW)", "adamw_torch (fused or not) only", c.optim),
    Key("seed", 42, _M, "training.seed", "seeds the data order and LoRA's init", c.to("training.seed")),
    Key("data_seed", None, NO_EFFECT, note="the data order is seeded by seed"),
    Key("bf16", False, _M, "training.precision", apply=c.precision),
    Key("fp16", False, _M, "training.precision", "as bf16"),
    Key("tf32", None, NO_EFFECT, note="PyTorch's default matmul precision"),
    Key(
        "logging_steps",
        500,
        _M,
        "training.log_every_steps",
        apply=lambda v, r: r.set("training.log_every_steps", max(1, int(v))),
    ),
    Key("logging_strategy", "steps", NO_EFFECT, note="metrics every logging_steps"),
    Key(
        "save_steps",
        500,
        _M,
        "checkpoint.every_steps",
        "checkpoints are crash-safe and load at any world size",
        lambda v, r: r.set("checkpoint.every_steps", max(1, int(v))),
    ),
    Key("save_strategy", "steps", _M, "(steps only)", apply=c.save_strategy),
    Key("save_total_limit", None, _M, "checkpoint.keep_last", "not set: the last 2", c.save_limit),
    Key("report_to", "none", _M, "(MLflow)", "every run is one MLflow run whatever it says", c.report_to),
    Key("run_name", None, _M, "run.name", "else output_dir's last part"),
    Key("logging_dir", None, NO_EFFECT, note="metrics go to MLflow and RUN_DIR"),
    Key("disable_tqdm", False, NO_EFFECT, note="progress is one line a step"),
    Key(
        "ddp_timeout",
        1800,
        NO_EFFECT,
        note="elastictrain's own collective timeout "
        "(failure.collective_timeout_s) detects hung ranks; a long one would hide a hang",
    ),
    Key("ddp_find_unused_parameters", None, NO_EFFECT, note="DeepSpeed reduces every gradient"),
    Key("dataloader_num_workers", 0, NO_EFFECT, note="samples are tokenized up front; batches are slices"),
    Key("dataloader_pin_memory", True, NO_EFFECT, note=_NOT_HERE),
    Key("remove_unused_columns", True, NO_EFFECT, note="samples hold only ids and labels"),
    Key(
        "gradient_checkpointing",
        None,
        NO_EFFECT,
        note="disable_gradient_checkpointing decides, as in LLaMA-Factory",
    ),
    Key("include_num_input_tokens_seen", False, NO_EFFECT, note="tokens are counted in the metrics"),
    Key("push_to_hub", False, REFUSED, note="nothing is uploaded; export with `elastictrain export`"),
    Key("per_device_eval_batch_size", 8, NO_EFFECT, note="validation batches are global batches"),
    Key(
        "eval_strategy",
        "no",
        REFUSED,
        note="give eval.every_steps=N and eval.steps=M (with eval.split or eval.data)",
    ),
    Key("eval_steps", None, REFUSED, note="eval.every_steps"),
    # --- Ray (LLaMA-Factory's own Ray launcher)
    Key(
        "ray_num_workers",
        1,
        _M,
        "scaling.max_workers",
        "the starting world size; else this machine's GPUs "
        "(1 without any); scaling.min_workers defaults to 1",
    ),
    Key("ray_run_name", None, _M, "run.name", apply=c.to("run.name")),
    Key("ray_storage_path", None, NO_EFFECT, note="the run folder is output_dir"),
    Key("resources_per_worker", None, NO_EFFECT, note="scaling.gpus_per_worker, scaling.cpus_per_worker"),
    Key("placement_strategy", "PACK", NO_EFFECT, note="workers spread over nodes as capacity allows"),
    Key("ray_init_kwargs", None, NO_EFFECT, note="ray.address (or RAY_ADDRESS) names the cluster"),
    # --- merge files' keys, read by `elastictrain export -c FILE`
    *(
        Key(name, default, NO_EFFECT, note="read by `elastictrain export -c FILE` (a merge file)")
        for name, default in (
            ("export_dir", None),
            ("export_size", 5),
            ("export_device", "cpu"),
            ("export_legacy_format", False),
            ("export_quantization_bit", None),
            ("export_quantization_dataset", None),
            ("export_hub_model_id", None),
        )
    ),
)
BY_NAME = {k.name: k for k in KEYS}
# Top-level keys that say a YAML file is LLaMA-Factory's (no elastictrain section is named like them).
MARKERS = ("stage", "model_name_or_path", "finetuning_type", "dataset", "output_dir")
