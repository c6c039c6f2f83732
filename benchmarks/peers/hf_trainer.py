"""Hugging Face's `Trainer` on instruction samples: what LLaMA-Factory runs underneath, for benchmarks/sft.py.

One rank of a `torchrun` job on CPU (gloo), with the Trainer's DeepSpeed integration at ZeRO stage 3
(LLaMA-Factory's ds_z3_config.json; the Trainer makes the optimizer, torch's AdamW). The samples are
elastictrain's own, already tokenized and masked ({"input_ids", "labels"} per line, in elastictrain's
data order), read in that order (train_sampling_strategy="sequential"): rank r's micro-batch k is global
batch slice k * world + r in both systems, so every step pads exactly the same records. A micro-batch is
padded to its longest record (labels -100, attention 0), as LLaMA-Factory's DataCollatorForSeq2Seq does.

Rank 0 appends {"step", "time"} per optimizer step to spec["steps_file"] and writes spec["out"]:
train_begin (wall clock after the model, DeepSpeed engine and data loader are ready), setup_s (from
the process start) and the Trainer's own metrics.

    torchrun --nproc-per-node N benchmarks/peers/hf_trainer.py --spec SPEC.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
STARTED = time.time()

# LLaMA-Factory's examples/deepspeed/ds_z3_config.json ("auto" values filled in by the Trainer).
ZERO3 = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


class Samples:
    """Map-style dataset of the tokenized samples, one JSON object per line."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            self.items = [json.loads(line) for line in f if line.strip()]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def pad_collate(pad_id: int, batches_file: str | None = None) -> Any:
    """Pad to the micro-batch's longest record; each rank appends its micro-batches' record lengths to
    `batches_file` (the benchmark checks they are elastictrain's)."""
    import torch

    rank = int(os.environ.get("RANK", "0"))

    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        longest = max(len(x["input_ids"]) for x in items)
        if batches_file:
            with open(batches_file, "a") as f:
                f.write(json.dumps({"rank": rank, "lengths": [len(x["input_ids"]) for x in items]}) + "\n")

        def padded(key: str, fill: int) -> Any:
            return torch.tensor([x[key] + [fill] * (longest - len(x[key])) for x in items])

        mask = torch.tensor(
            [[1] * len(x["input_ids"]) + [0] * (longest - len(x["input_ids"])) for x in items]
        )
        return {
            "input_ids": padded("input_ids", pad_id),
            "labels": padded("labels", -100),
            "attention_mask": mask,
        }

    return collate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    with open(parser.parse_args().spec) as f:
        spec = json.load(f)

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model.config.use_cache = False
    args = TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["grad_accum_steps"],
        num_train_epochs=1,
        learning_rate=spec["lr"],
        adam_beta1=spec["adam_betas"][0],
        adam_beta2=spec["adam_betas"][1],
        weight_decay=0.0,
        max_grad_norm=spec["grad_clip"],
        lr_scheduler_type="cosine",
        warmup_steps=spec["warmup_steps"],
        optim="adamw_torch",
        use_cpu=True,  # gloo; the Trainer still wraps the model in a DeepSpeed engine
        ddp_backend="gloo",
        deepspeed=ZERO3 if spec.get("deepspeed", True) else None,  # None: its default set-up (DDP)
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        remove_unused_columns=False,
        save_strategy="no",
        logging_steps=10,  # LLaMA-Factory's example configs
        report_to=[],
        disable_tqdm=True,
        seed=spec["seed"],
    )
    rank0 = int(os.environ.get("RANK", "0")) == 0
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks["train_begin"] = time.time()

        def on_step_end(self, _args: Any, state: Any, *a: Any, **k: Any) -> None:
            if rank0:
                with open(spec["steps_file"], "a") as f:
                    f.write(json.dumps({"step": state.global_step, "time": time.time()}) + "\n")

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Samples(spec["samples_file"]),
        data_collator=pad_collate(spec["pad_id"], spec.get("batches_file")),
        callbacks=[Clock()],
    )
    output = trainer.train()
    if rank0:
        out = {
            "train_begin": marks["train_begin"],
            "setup_s": marks["train_begin"] - STARTED,
            "deepspeed": type(trainer.model_wrapped).__name__,
            "world_size": args.world_size,
            "global_step": output.global_step,
            "metrics": output.metrics,
        }
        with open(spec["out"], "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a gloo thread still alive there aborts the process ("terminate called
    # without an active exception") after training has finished and its results are written.
    os._exit(0)
