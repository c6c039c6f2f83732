"""TRL's `DPOTrainer` on preference pairs (what LLaMA-Factory's DPO stage runs), for benchmarks/dpo.py.

One rank of a `torchrun` job on CPU (gloo), with the Trainer's DeepSpeed integration at ZeRO stage 3
(LLaMA-Factory's ds_z3_config.json, benchmarks/peers/hf_trainer.py's ZERO3). The pairs are elastictrain's
own, already encoded through the chat template and cut at the cutoff ({"index", "prompt_ids",
"chosen_ids", "rejected_ids"} per row of an Arrow dataset, in elastictrain's data order), read in that
order (train_sampling_strategy="sequential"): rank r's micro-batch k is global slice k * world + r in
both systems, so every step pads exactly the same pairs. The only change to TRL is that its dataset
preparation (prompt extraction, chat template, tokenization) is skipped for these already tokenized rows;
its collator (DataCollatorForPreference: chosen rows then rejected rows, right-padded to the longest),
its loss, its reference handling and its training loop are TRL's own.

The reference: with `lora`, the model with its adapters off, in each step (TRL's PEFT path); a full
fine-tune with `precompute_ref` computes the starting model's log-probabilities of every pair before
training (precompute_ref_log_probs=True, timed as ref_s, before on_train_begin), and without it a second,
frozen ZeRO-3 copy of the model runs in each step (TRL's default).

Rank 0 appends {"step", "time"} per optimizer step and {"step", "loss", ...} per log (every step) to
spec["steps_file"] and writes spec["out"]: train_begin (wall clock after the models, DeepSpeed engines,
reference pass and data loader are ready), ref_s, setup_s (from the process start) and the Trainer's
metrics. Each rank appends the indices of its micro-batches' pairs to spec["batches_file"].

    torchrun --nproc-per-node N benchmarks/peers/trl_dpo.py --spec SPEC.json
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


class RecordingCollator:
    """TRL's collator, unchanged; each rank also appends its micro-batch's pair indices to `path`."""

    def __init__(self, inner: Any, path: str | None) -> None:
        self.inner = inner
        self.path = path
        self.rank = int(os.environ.get("RANK", "0"))
        self.active = False  # the reference precompute's batches are not training's

    def __call__(self, examples: list[dict[str, Any]]) -> Any:
        if self.active and self.path:
            with open(self.path, "a") as f:
                f.write(
                    json.dumps({"rank": self.rank, "indices": [int(x["index"]) for x in examples]}) + "\n"
                )
        return self.inner(examples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    with open(parser.parse_args().spec) as f:
        spec = json.load(f)

    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from benchmarks.peers.hf_trainer import ZERO3

    rank0 = int(os.environ.get("RANK", "0")) == 0
    marks: dict[str, float] = {"ref_s": 0.0}

    class PretokenizedDPOTrainer(DPOTrainer):
        """DPOTrainer fed rows elastictrain already encoded: its own dataset preparation is skipped."""

        def _prepare_dataset(self, dataset: Any, *_a: Any, **_k: Any) -> Any:
            return dataset

        def _precompute_ref_logps(self, *a: Any, **k: Any) -> Any:
            t0 = time.time()
            try:
                return super()._precompute_ref_logps(*a, **k)
            finally:
                marks["ref_s"] += time.time() - t0

    args = DPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["grad_accum_steps"],
        num_train_epochs=1,
        learning_rate=spec["lr"],
        adam_beta1=spec["adam_betas"][0],
        adam_beta2=spec["adam_betas"][1],
        weight_decay=0.0,
        max_grad_norm=spec["grad_clip"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        use_cpu=True,  # gloo; the Trainer still wraps the model in a DeepSpeed engine
        ddp_backend="gloo",
        deepspeed=ZERO3,
        bf16=False,  # DPOConfig's default is bf16: fp32 here, as elastictrain
        fp16=False,
        gradient_checkpointing=False,  # DPOConfig's default is on: off here, as elastictrain
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        remove_unused_columns=False,  # keeps the pairs' "index" (the collator reads only its own keys)
        save_strategy="no",
        logging_steps=1,  # every step's loss, as elastictrain reports it
        report_to=[],
        disable_tqdm=True,
        seed=spec["seed"],
        beta=spec["beta"],
        loss_type=["sigmoid"],
        max_length=spec["max_length"],  # the cutoff: every row already fits it
        precompute_ref_log_probs=bool(spec["precompute_ref"]),
        disable_dropout=True,
    )
    # After the DeepSpeed arguments, as LLaMA-Factory loads it: ZeRO-3 partitions the model as it loads
    # (zero.Init), which reads the world size from deepspeed.comm. On GPUs accelerate starts it with the
    # process group; on CPU (use_cpu) it starts only torch's, so deepspeed.comm is joined to it here.
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    peft_config = None
    if spec.get("lora"):
        from peft import LoraConfig

        lora = spec["lora"]
        peft_config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=0.0,
            target_modules=lora["target_modules"],
            task_type="CAUSAL_LM",
        )

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks["train_begin"] = time.time()

        def on_step_end(self, _args: Any, state: Any, *a: Any, **k: Any) -> None:
            if rank0:
                with open(spec["steps_file"], "a") as f:
                    f.write(json.dumps({"step": state.global_step, "time": time.time()}) + "\n")

        def on_log(self, _args: Any, state: Any, _control: Any, logs: Any = None, **k: Any) -> None:
            if rank0 and logs and "loss" in logs:
                with open(spec["steps_file"], "a") as f:
                    f.write(json.dumps({"event": "log", "step": state.global_step, **logs}) + "\n")

    trainer = PretokenizedDPOTrainer(
        model=model,
        args=args,
        train_dataset=load_from_disk(spec["dataset_dir"]),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    recording = RecordingCollator(trainer.data_collator, spec.get("batches_file"))
    trainer.data_collator = recording
    recording.active = True
    output = trainer.train()
    if rank0:
        engine = trainer.model_wrapped
        out = {
            "train_begin": marks["train_begin"],
            "ref_s": marks["ref_s"],
            "setup_s": marks["train_begin"] - STARTED,
            "deepspeed": type(engine).__name__,
            "reference": (
                "adapters off"
                if peft_config is not None
                else "precomputed"
                if spec["precompute_ref"]
                else type(trainer.ref_model).__name__
            ),
            "trainable_parameters": sum(
                getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters() if p.requires_grad
            ),
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
