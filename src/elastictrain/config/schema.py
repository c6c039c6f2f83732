"""The configuration schema: typed dataclasses, defaults = the tiny CPU demo.

OmegaConf turns these into a structured config, so unknown keys and wrong types are rejected when a
YAML file or a dotlist override is merged in.

Each key's description is the comment beside it, or the comment lines right above it; a section's is
its class docstring. docs/reference/config.md is generated from them (`make docs-reference`), and a
test fails when a key has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _tiny_llama() -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }


@dataclass
class RunConfig:
    """Which run, and where its folder is."""

    name: str = "tiny-cpu"  # the run's name (no '/'): the default run.dir is runs/NAME
    # The run folder: a local path or an object-store URL (s3://bucket/runs/x). It holds run.json,
    # config.yaml, events.jsonl and checkpoints/, and is what `resume`, `status` and `export` take.
    dir: str = "runs/${run.name}"


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on top of the model; only the adapters (and modules_to_save) train, are
    checkpointed and are saved at the end. docs/lora.md: each key's LLaMA-Factory name."""

    enabled: bool = False  # wrap the model with LoRA adapters
    r: int = 8  # the adapters' rank
    alpha: float = 16.0  # the adapters' scale is alpha/r (alpha/sqrt(r) with use_rslora)
    dropout: float = 0.0  # dropout on the adapters' input
    # A list of layer names (the last part of a module's name), or all-linear (also `all`, LLaMA-Factory's
    # spelling): every linear layer but the output head. A string or a list, so typed Any.
    target_modules: Any = field(default_factory=lambda: ["q_proj", "v_proj"])
    use_dora: bool = False  # DoRA: a trained magnitude vector per adapted layer, next to A and B
    use_rslora: bool = False  # rank-stabilized scale alpha/sqrt(r) instead of alpha/r
    # Modules trained in full (a trainable copy each, in the optimizer and checkpoints) and saved with the
    # adapter, e.g. [lm_head, embed_tokens] for new tokens (LLaMA-Factory's additional_target).
    modules_to_save: list[str] = field(default_factory=list)
    export_dir: str = "${run.dir}/adapter"  # written when the run finishes (peft's save_pretrained layout)


@dataclass
class ModelConfig:
    """The model, from one of three sources: `factory` (your code), `pretrained` (a local transformers
    folder), else `hf_config` (a transformers config, randomly initialized as from_config does)."""

    # A transformers config as a mapping, passed to AutoConfig.for_model(model_type, **rest); used when
    # neither factory nor pretrained is set. The default is a 2.75M-parameter Llama with a byte vocabulary.
    hf_config: dict[str, Any] = field(default_factory=_tiny_llama)
    pretrained: str | None = None  # a local folder for AutoModelForCausalLM.from_pretrained (no hub)
    factory: str | None = None  # "module:attr": called as attr(config) (or attr()), returns a torch.nn.Module
    args: dict[str, Any] = field(default_factory=dict)  # free-form, for your factory (config.model.args)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # The attention kernel: auto (flash_attention_2 on GPUs in bf16/fp16 where the flash-attn package is
    # installed, else transformers' default: sdpa where the model has it) | eager | sdpa | flash_attention_2
    # | flash_attention_3 | flex_attention
    attn_implementation: str = "auto"
    # torch.compile the model (DeepSpeed's engine.compile, inductor): each attempt compiles again on its
    # first steps; measured in docs/guides/automatic-layout.md
    compile: bool = False


@dataclass
class DataConfig:
    """The training data: where samples come from, and how they are tokenized and cut. Nothing is
    downloaded: every source reads local files or your code."""

    # Where samples come from: generated (a corpus from a small grammar) | file (a UTF-8 text file) | hf
    # (local files read with Hugging Face datasets) | tokens (token shards) | factory (your dataset) | sft
    # (instruction records)
    source: str = "generated"
    path: str | None = None  # file: a UTF-8 text file; hf: data file(s), a glob allowed; tokens: a folder
    generated_chars: int = 400_000  # source=generated: the corpus's length in characters
    seq_len: int = 64  # tokens per sample
    # source=hf (Hugging Face datasets on local files): json | csv | parquet | text; default: from
    # data.path's extension
    format: str | None = None
    text_field: str = "text"  # the column tokenized (json, csv, parquet)
    tokenizer: str | None = None  # a local folder (AutoTokenizer.from_pretrained)
    # true: concatenate and cut into seq_len blocks; false: pad/truncate each record (source=sft: true
    # packs whole records into bins of seq_len, a bin per sample, no record attending to another; false
    # pads each micro-batch to its longest record)
    packing: bool = True
    # source=tokens: shards of token ids (.bin/.npy, `elastictrain prepare-data`); the dtype of .bin
    # shards when their folder has no index.json yet (uint16 | uint32; default: the index's, else uint16)
    dtype: str | None = None
    # source=factory: your dataset. "module:attr", called as attr(config) (or attr()); needs __len__ and
    # __getitem__(int).
    factory: str | None = None
    collate: str | None = None  # "module:attr": list of items -> batch (default: stack tensors / dicts)
    args: dict[str, Any] = field(default_factory=dict)  # free-form, for your factories (config.data.args)
    # source=sft: instruction records (docs/instruction-data.md) from data.path (json, jsonl, csv, parquet)
    # or from data.dataset_dir's dataset_info.json (LLaMA-Factory's), rendered with the chat template of
    # data.tokenizer (else model.pretrained's) or data.template; labels -100 except on the answers.
    formatting: str | None = None  # alpaca | sharegpt | openai; default: detected from the records
    # LLaMA-Factory's column renames (prompt, query, response, history, system, messages, tools); a mapping
    # given names every column read, as in dataset_info.json
    columns: dict[str, Any] = field(default_factory=dict)
    # LLaMA-Factory's tag renames (role_tag, content_tag, user_tag, assistant_tag, observation_tag,
    # function_tag, system_tag); a mapping given names every tag read, as in dataset_info.json
    tags: dict[str, Any] = field(default_factory=dict)
    dataset_dir: str | None = None  # a folder holding dataset_info.json
    dataset: Any = None  # names in dataset_info.json: "a,b" or a list; trained on in that order
    max_samples: int | None = None  # the first N records of each dataset
    template: str | None = None  # a Jinja chat template file, instead of the tokenizer's own
    system: str | None = None  # the system prompt of records that have none
    # How tool calls and tools reach the template (docs/instruction-data.md, Tool calls). null: the chat
    # template renders tool_calls and tools, refused if it leaves one out | json: tools as a JSON list in
    # the system turn, calls as {"name", "arguments"} JSON in the answer | qwen: LLaMA-Factory's qwen
    # (Hermes) text: `<tools>` in the system turn, `<tool_call>` in the answer, `<tool_response>` user turns
    tool_format: str | None = None
    train_on_prompt: bool = False  # also train on the prompt tokens
    mask_history: bool = False  # train only on each conversation's last answer
    on_bad_record: str = "error"  # error: name bad records and refuse to start | skip: drop and count them


@dataclass
class EvalConfig:
    """Validation: `steps` global batches of the validation set, every `every_steps` optimizer steps
    (0: only at the end) and at the end of the run. The set is `split` (a fraction) of the training
    data, held out so training never reads it, or a source of its own in `data` (the options of `data`)."""

    every_steps: int = 0  # validate every this many optimizer steps (0: only at the end of the run)
    steps: int = 0  # global batches per validation (0: no validation)
    # The fraction of the training data held out for validation: seeded, the same samples at every start
    # and world size, never trained on
    split: float = 0.0
    data: DataConfig | None = None  # a validation source of its own, with data's keys (unset ones: data's)
    # What the model says (docs/validation.md): at every validation, greedy completions of `prompts`, a
    # list of strings or N (the prompt part of the validation set's first N records; so typed Any).
    prompts: Any = None
    max_new_tokens: int = 32  # the longest completion of each eval.prompts prompt, in tokens
    chat_template: bool = True  # string prompts go through the tokenizer's chat template where it has one


@dataclass
class TrainingConfig:
    """Batch, length, optimizer and LR schedule: what a step computes, the same at every world size."""

    # Samples per optimizer step at every world size (micro batch x accumulation steps x world size)
    global_batch_size: int = 24
    # The largest per-rank micro batch; the split is recomputed per world size. auto: the largest that
    # divides each replica's share of the global batch and fits the memory (docs/guides/automatic-layout.md)
    micro_batch_size: Any = 4
    max_steps: int = 40  # optimizer steps of the run, and the LR schedule's length
    # Instead of max_steps: passes over the training set (after eval.split). At start max_steps becomes
    # ceil(num_epochs x training samples / global_batch_size), printed and written to the run's config.yaml
    # with epoch_samples (core/run_length.py: why rounded up). Resuming with training.num_epochs=N extends it.
    num_epochs: float | None = None
    epoch_samples: int | None = None  # written at start with num_epochs: the training samples it counted
    lr: float = 3e-3  # the peak learning rate, reached at the end of the warm-up
    min_lr: float = 3e-4  # the learning rate the cosine or linear decay ends at
    warmup_steps: int = 4  # steps of linear warm-up to lr
    warmup_ratio: float | None = None  # instead of warmup_steps: ceil(ratio x max_steps), fixed at start
    lr_schedule: str = "cosine"  # the decay after the warm-up: cosine | linear | constant
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # AdamW's beta1
    adam_beta2: float = 0.95  # AdamW's beta2
    adam_eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # the largest global gradient norm; 0 disables clipping
    seed: int = 42  # seeds the model's initialization, the data order and every random draw
    precision: str = "fp32"  # fp32 | bf16 | fp16
    log_every_steps: int = 1  # print and log the metrics every this many steps
    # "module:attr": loss(model, batch) -> scalar tensor. Default: the causal LM loss of a transformers
    # model (labels = input_ids unless the batch has labels).
    loss: str | None = None
    # What a step optimizes: lm (the causal LM loss: pre-training, supervised fine-tuning) | dpo (pairs
    # against a reference: preference.dpo_loss) | orpo | simpo (pairs, no reference) | kto (unpaired
    # answers marked desirable or not, against a reference). Every objective but lm reads preference
    # records with data.source sft's keys (docs/preference.md).
    objective: str = "lm"


@dataclass
class PreferenceConfig:
    """Preference objectives (training.objective dpo, orpo, simpo, kto): the published losses, as TRL
    computes them, on each answer's summed token log-probabilities; a step's loss is the mean over the
    global batch's pairs (or KTO records) at any world size. docs/preference.md: LLaMA-Factory's names."""

    dpo_loss: str = "sigmoid"  # dpo: sigmoid (DPO) | hinge (SLiC) | ipo (IPO, on mean token log-probs)
    # The strength of the reference's pull (DPO, IPO, hinge, KTO), the odds-ratio weight (ORPO), the
    # reward scale (SimPO): LLaMA-Factory's pref_beta
    beta: float = 0.1
    label_smoothing: float = 0.0  # dpo sigmoid and simpo: conservative DPO's assumed share of flipped labels
    # Adds ftx x the chosen answer's mean token NLL to each pair's loss (KTO: each desirable answer's);
    # LLaMA-Factory's pref_ftx
    ftx: float = 0.0
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    kto_desirable_weight: float = 1.0  # kto: the weight of desirable answers' losses
    kto_undesirable_weight: float = 1.0  # kto: the weight of undesirable answers' losses
    # dpo and kto: where the reference's log-probabilities come from. auto: adapters (LoRA runs) else
    # precomputed | adapters: the model with its LoRA adapters off, in the step (no second copy) |
    # precomputed: the starting model's, computed once before the first step on the workers and kept in
    # RUN_DIR/reference/ (every restart, resize and resume reads them)
    reference: str = "auto"


@dataclass
class DeepSpeedConfig:
    """How ranks hold the state: the DeepSpeed config is generated from these (or read from config_file)."""

    # 0, 1, 2 or 3: what is partitioned between ranks. auto (on this and the three below): the layout with
    # the least communication and recomputation that fits each rank's memory, chosen at the start and at
    # every world size, printed with its estimate (docs/guides/automatic-layout.md); values you set stay
    zero_stage: Any = 3
    # where the optimizer state lives: none | cpu | nvme (nvme: stage 3) | auto
    offload_optimizer: str = "none"
    offload_param: str = "none"  # where the parameters live between uses: none | cpu | nvme (stage 3) | auto
    # A node-local folder for NVMe offload, checked writable on every node before training; each rank
    # swaps into NVME_PATH/RUN_ID/rank-N
    nvme_path: str | None = None
    activation_checkpointing: Any = False  # recompute activations in backward instead of keeping them | auto
    config_file: str | None = None  # your own DeepSpeed JSON (Hugging Face style "auto" values allowed)
    extra: dict[str, Any] = field(default_factory=dict)  # deep-merged into the generated DeepSpeed config


@dataclass
class ScalingConfig:
    """How many workers, and what each holds."""

    # The smallest world size the run goes on at; with fewer workers it waits for capacity
    # (failure.wait_for_capacity_s)
    min_workers: int = 2
    max_workers: int = 2  # the largest world size: the run grows to it as capacity appears
    # Ranks per data-parallel replica, splitting every layer's matrices between them (DeepSpeed's AutoTP,
    # Megatron-style): world size / N replicas of N ranks, each replica on one node. min_workers and
    # max_workers count ranks and must be multiples of N. A DeepSpeed JSON's tensor_parallel.autotp_size
    # sets it too. auto: the smallest N (no more than a node's ranks) whose memory estimate fits, chosen
    # when the driver starts and again at each restart at a new world size, the choice printed.
    tensor_parallel: Any = 1
    # Stages per data-parallel replica: a transformers decoder (llama, qwen2, mistral) split into P
    # contiguous runs of layers, trained through DeepSpeed's pipeline engine (ZeRO stage 0 or 1): world
    # size / P replicas of P ranks, each replica on one node. min_workers and max_workers count ranks and
    # must be multiples of P. Checkpoints keep transformers' parameter names: they load at any layout.
    # auto: P chosen by a cost model (compute, the pipeline bubble, traffic, memory per rank) when the
    # driver starts and again at each restart at a new world size, the choice and runner-up printed.
    pipeline_parallel: Any = 1
    # Warm actors kept beside the attempt's workers, each holding its slot (a GPU) idle: one replaces a
    # worker or node lost at once, instead of after a new actor's start and imports (seconds to tens of
    # seconds), where the run cannot go on smaller (at min_workers). They join a grow like any warm worker.
    spare_workers: int = 0
    use_gpu: bool = False  # workers on GPUs (gpus_per_worker each) instead of CPU slots
    cpus_per_worker: float = 1.0  # CPUs Ray reserves for each worker
    gpus_per_worker: float = 1.0  # GPUs Ray reserves for each worker, with use_gpu
    # The workers' malloc: jemalloc (the copy Ray ships, freed memory kept for reuse: a lower peak and
    # quicker steps than glibc's on CPU) or system. The driver's MALLOC_CONF replaces jemalloc's settings.
    worker_allocator: str = "jemalloc"
    # Seconds a finished run's warm workers stay parked for the next run this driver starts (a sweep, a
    # notebook calling fit again): one asking for the same resources takes them back and skips each
    # worker's start and imports. They keep their slots (GPUs) reserved meanwhile. 0: workers end with
    # the run. Runs whose model, data or loss come from a module of yours always start new workers (a
    # warm process keeps the module it imported).
    keep_warm_s: float = 0.0


@dataclass
class CheckpointConfig:
    """Disk checkpoints (durable, what resume loads) and in-memory snapshots (what a restart loads)."""

    every_steps: int = 10  # commit a disk checkpoint every this many optimizer steps
    keep_last: int = 2  # committed checkpoints kept; older ones are deleted
    # Training pauses only for a host-memory snapshot; each rank writes its file in a background thread
    # (one more copy of the rank's state in host memory while it writes). false: write before going on.
    background_write: bool = True
    # Also keep the checkpoint at the step of the lowest validation loss (when one was saved at that step).
    keep_best: bool = False
    # Host memory one rank's snapshot may take (MB). A rank whose state is larger streams its file from
    # the live state instead (training waits for the write; nothing is copied). null: half the memory
    # available at save time, split between the node's ranks.
    max_host_memory_mb: float | None = None
    # Each rank copies its slice of the state to host memory after every this many steps at most often
    # (0: never), and a buddy worker on another node holds a replica: a failure then restarts from memory,
    # losing the steps since that copy, and disk checkpoints stay for resuming after the driver is lost.
    memory_every_steps: int = 1
    # The share of training time the copies and replicas may cost: the controller measures them and spaces
    # the snapshots out (the same steps on every rank) until they cost no more. 0: every memory_every_steps.
    # They are also turned off where their copies would not fit in max_host_memory_mb.
    memory_max_step_share: float = 0.03


@dataclass
class TrackingConfig:
    """MLflow: one MLflow run per run, across every restart and resize."""

    # An MLflow server or sqlite:///FILE; None: an embedded SQLite store inside the run folder (a file:
    # URI or a folder is refused)
    uri: str | None = None
    experiment: str = "elastictrain"  # the MLflow experiment
    # The spool's bound during an MLflow outage: warned at 80%; when full, new metrics are dropped.
    max_spool_mb: float = 1024.0
    # MLflow's system metrics (CPU, memory, disk, network; GPU where present), sampled on the driver.
    system_metrics: bool = True
    system_metrics_interval_s: float = 10.0  # seconds between two samples of the system metrics
    plots: bool = True  # PNGs of the run's metrics in RUN_DIR/plots at its end, logged to the MLflow run


@dataclass
class FailureConfig:
    """When a failure is detected, and how many the run recovers from."""

    # Transient failures (lost workers or nodes, hangs, an error seen once) recovered from before the run
    # fails; an error that recurs unchanged at the same step ends the run at once
    max_failures: int = 3
    hang_timeout_s: float = 120.0  # no step completed within this many seconds is a hang
    collective_timeout_s: float = 300.0  # the process groups' timeout for one collective
    # How long the run waits for capacity for min_workers (after a failure or at start) before failing
    wait_for_capacity_s: float = 60.0
    # A worker still starting (its process, imports, ops, data) after this many seconds, and three times the
    # longest start that finished, is named, stopped and started again, so a start that hangs never holds
    # the run (it would otherwise wait for it without end); while none has finished, three times this. A
    # cold start takes tens of seconds; starts slow alike (a large dataset to tokenize) get the longer bound
    warmup_timeout_s: float = 600.0
    # A rank whose forward passes take more than this times the other ranks' median for straggler_steps
    # consecutive steps is named (log, events, status, MLflow) with its node; 0: off. 1.3: a GPU's clock
    # throttling or a noisy neighbour shows as 1.5x and more, step-to-step noise stays within 1.2x
    straggler_factor: float = 1.3
    straggler_steps: int = 5  # consecutive slow steps: one-off pauses (a collection, a copy) are not named
    # A named straggler is stopped and replaced: the others go on from memory (the step in flight lost), a
    # new worker joins by a grow once warm; it counts against max_failures. Off by default: a slow rank may
    # be slow for a while only, and a swap costs a restart and a worker's start
    replace_stragglers: bool = False
    # A straggler's node gets no new workers for this long once it is replaced or dropped: a throttled
    # device or a noisy neighbour tends to stay so for a while. 0: no avoiding
    straggler_avoid_s: float = 1800.0
    # Steps not applied in a row (a non-finite loss or gradient) before the run returns to the in-memory
    # snapshot before the first of them (disk if none) and skips their batches; 0: never. 3: one bad batch,
    # or two, is data; three in a row is a state gone bad (a corrupted weight, a device's silent error).
    # fp16's loss-scale overflows with a finite loss are its scaler calibrating and do not count
    max_bad_steps: int = 3
    # A second rollback whose first step is within this many steps of the last one's stops the run, naming
    # the steps and samples: going back again would repeat it
    bad_steps_window: int = 200
    # A loss above this times the median of the last loss_spike_window steps' is a spike: the run returns
    # to the snapshot before it and skips its batch. 0: off (opt-in: early losses fall fast). With it on,
    # snapshots are at least 2 steps apart, so the one before a spike is still held when it is seen
    loss_spike: float = 0.0
    loss_spike_window: int = 20  # steps in the running median; none is judged before that many


@dataclass
class RayConfig:
    """The Ray cluster the driver connects to."""

    address: str | None = None  # None: --address, RAY_ADDRESS, else a local cluster
    num_cpus: int | None = None  # CPUs of a local cluster (default: this machine's own)


@dataclass
class Config:
    """The whole configuration, one section per key."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    ray: RayConfig = field(default_factory=RayConfig)
