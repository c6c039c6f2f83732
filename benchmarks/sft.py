"""Instruction fine-tuning, one epoch: elastictrain against Hugging Face's `Trainer` (what LLaMA-Factory
runs), samples/s and real (non-padding) tokens/s at 1 and 2 processes. Opt-in: `--only sft`.

Both train the same pretrained model folder (a Llama made with transformers from a small config,
examples/sft/prepare.py) on the same chat records (alpaca and sharegpt, through a dataset_info.json),
for one epoch, fp32, ZeRO stage 3 on CPU with gloo, one thread per rank, the same global and micro batch.
elastictrain reads them with `data.source: sft` (training.num_epochs=1, data.packing=false: one record
per sample, each micro-batch padded to its longest record). The Trainer gets those very samples,
tokenized and masked by elastictrain and written in elastictrain's data order, read sequentially, so
both pad the same records together at every step (benchmarks/peers/hf_trainer.py); it runs under
torchrun with its DeepSpeed integration at stage 3 (LLaMA-Factory's ds_z3_config.json).

The measured time is the epoch itself: from the moment each system is ready to train (elastictrain:
its workers set up, the attempt started; the Trainer: on_train_begin, after its DeepSpeed engine and
data loader are built) to the end of the last optimizer step. Start-up is reported beside it. Each
record is read once (the records are a whole number of global batches).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BIN,
    ROOT,
    Result,
    Target,
    Workload,
    _kill_group,
    _read_json,
    _read_lines,
    _remove_shm,
    free_port,
    load,
    median,
    peer_env,
    ratio,
    record_steps,
    run_elastictrain,
)

TRAINER_SCRIPT = ROOT / "benchmarks" / "peers" / "hf_trainer.py"
# elastictrain_trainer_json: elastictrain run with the Trainer's DeepSpeed JSON (deepspeed.config_file),
# to tell its own ZeRO-3 settings from the rest; not in the smoke run.
# elastictrain_auto: the layout chosen for the run (deepspeed.zero_stage=auto: ZeRO-0 in fp32 here),
# against hf_trainer_default: the Trainer in its default set-up (no DeepSpeed; DDP at 2 processes) with
# torch's default threads, as a user who installs transformers gets it.
SYSTEMS = (
    "elastictrain",
    "elastictrain_trainer_json",
    "hf_trainer",
    "elastictrain_auto",
    "hf_trainer_default",
)


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    steps: int  # one epoch: records = steps x global batch
    global_batch: int
    micro_batch: int
    seq_len: int  # cutoff_len
    world_sizes: tuple[int, ...]
    timeout_s: float

    @property
    def records(self) -> int:
        return self.steps * self.global_batch


SMOKE = Size(
    hidden=64, layers=2, steps=3, global_batch=8, micro_batch=4, seq_len=128, world_sizes=(2,), timeout_s=240
)
FULL = Size(
    hidden=256,
    layers=4,
    steps=40,
    global_batch=16,
    micro_batch=4,
    seq_len=128,
    world_sizes=(1, 2),
    timeout_s=600,
)
LR, BETAS, GRAD_CLIP, SEED = 1e-3, (0.9, 0.95), 1.0, 42


def _prepare_module() -> Any:
    spec = importlib.util.spec_from_file_location("sft_prepare", ROOT / "examples" / "sft" / "prepare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(tmp: Path, size: Size) -> tuple[Path, Path]:
    """The pretrained model folder (with its tokenizer) and the records' dataset_info.json folder."""
    # Half the records in each layout: the epoch is a whole number of global batches.
    return _prepare_module().prepare(
        tmp / "inputs", records=size.records // 2, hidden=size.hidden, layers=size.layers
    )


def config(model_dir: Path, data_dir: Path, run_dir: Path, size: Size, world_size: int, *extra: str) -> Any:
    warmup = max(1, size.steps // 10)
    return load(
        [
            f"run.dir={run_dir}",
            f"model.pretrained={model_dir}",
            "data.source=sft",
            f"data.dataset_dir={data_dir}",
            "data.dataset=word_tasks_alpaca,word_tasks_sharegpt",
            f"data.seq_len={size.seq_len}",
            "data.packing=false",
            "training.num_epochs=1",
            f"training.warmup_steps={warmup}",  # the file's max_steps gives way to num_epochs
            f"training.global_batch_size={size.global_batch}",
            f"training.micro_batch_size={size.micro_batch}",
            "training.precision=fp32",
            f"training.lr={LR}",
            f"training.adam_beta1={BETAS[0]}",
            f"training.adam_beta2={BETAS[1]}",
            f"training.grad_clip={GRAD_CLIP}",
            f"training.seed={SEED}",
            f"scaling.min_workers={world_size}",
            f"scaling.max_workers={world_size}",
            "checkpoint.every_steps=100000",  # one disk checkpoint, at the end, after the measured epoch
            "tracking.plots=false",
            "tracking.system_metrics=false",
            "failure.hang_timeout_s=120",
            "failure.collective_timeout_s=120",
            *extra,
        ]
    )


def write_samples(cfg: Any, path: Path) -> dict[str, Any]:
    """elastictrain's samples of the epoch, tokenized and masked, in its data order, one JSON line each."""
    from elastictrain.core.data_order import epoch_permutation
    from elastictrain.data.sources import dataset_from_config

    dataset = dataset_from_config(cfg)
    real = trained = 0
    lengths: list[int] = []
    with path.open("w") as f:
        for i in epoch_permutation(len(dataset), cfg.training.seed, 0):
            item = dataset[i]
            ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
            lengths.append(len(ids))
            real += len(ids)
            trained += sum(label != -100 for label in labels)
            f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
    return {
        "records": len(dataset),
        "real_tokens": real,
        "trained_tokens": trained,
        "pad_id": dataset.pad_token_id,
        "lengths": lengths,
    }


def _epoch(begin: float, step_times: list[float], size: Size, data: dict[str, Any]) -> dict[str, Any]:
    seconds = step_times[-1] - begin
    steady = step_times[-1] - step_times[0]  # the first step (one-time costs of both) left out
    return {
        "epoch_s": seconds,
        "steps": len(step_times),
        "samples_per_s": data["records"] / seconds,
        "real_tokens_per_s": data["real_tokens"] / seconds,
        "steady_samples_per_s": (data["records"] - size.global_batch) / steady if steady > 0 else None,
    }


def run_ours(cfg: Any, size: Size, data: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.baselines import ensure_local_ray
    from elastictrain.driver.launch import resolve_length

    ensure_local_ray()
    resolve_length(cfg)  # training.num_epochs -> max_steps, as `elastictrain train` does
    assert cfg.training.max_steps == size.steps, (cfg.training.max_steps, size.steps)
    steps: list[dict[str, Any]] = []
    begin: list[float] = []
    t0 = time.time()

    def hook(controller: Any) -> None:
        record_steps(steps)(controller)
        controller.callbacks.after_attempt_start.append(lambda _c: begin.append(time.time()))

    run_dir = run_elastictrain(cfg, hook)
    costs = next((e for e in run_dir.read_events() if e["event"] == "step_costs"), {})
    return {
        **_epoch(begin[0], [s["time"] for s in steps], size, data),
        "setup_s": begin[0] - t0,
        "median_engine_s": costs.get("median_engine_s"),  # the slowest rank's forward, backward, update
        "median_rest_s": costs.get("median_rest_s"),  # the rest of a step (core/step_cost.py)
    }


def run_trainer(
    world_size: int,
    size: Size,
    model_dir: Path,
    samples: Path,
    data: dict[str, Any],
    tmp: Path,
    *,
    deepspeed: bool = True,
) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {
        "model_dir": str(model_dir),
        "samples_file": str(samples),
        "pad_id": data["pad_id"],
        "micro_batch_size": size.micro_batch,
        "grad_accum_steps": size.global_batch // (size.micro_batch * world_size),
        "lr": LR,
        "adam_betas": list(BETAS),
        "grad_clip": GRAD_CLIP,
        "warmup_steps": max(1, size.steps // 10),
        "seed": SEED,
        "output_dir": str(tmp / "trainer-out"),
        "steps_file": str(tmp / "steps.jsonl"),
        "out": str(tmp / "out.json"),
        "batches_file": str(tmp / "batches.jsonl"),
        "deepspeed": deepspeed,
    }
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    cmd = [
        str(BIN / "torchrun"), f"--nproc-per-node={world_size}", "--nnodes=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=sft{port}",
        str(TRAINER_SCRIPT), "--spec", str(spec_path),
    ]  # fmt: skip
    t0 = time.time()
    log_path = tmp / "log.txt"
    with log_path.open("ab") as log:
        env = peer_env()
        if not deepspeed:  # torch's default threads: every core, or torchrun's one per process at 2
            env.pop("OMP_NUM_THREADS", None)
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=size.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
    _remove_shm(port)
    out = _read_json(Path(spec["out"]))
    steps = _read_lines(Path(spec["steps_file"]))
    if proc.returncode != 0 or out is None or len(steps) != size.steps:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"HF Trainer at {world_size} process(es): exit {proc.returncode}; log tail:\n{tail}"
        )
    # Under torchrun the Trainer wraps the model in DDP even at one process; with DeepSpeed, its engine.
    wrapped = "DeepSpeedEngine" if deepspeed else "DistributedDataParallel"
    if out["deepspeed"] != wrapped or out["world_size"] != world_size:
        raise RuntimeError(f"HF Trainer ran as {out['deepspeed']} at world size {out['world_size']}")
    same = same_batches(_read_lines(Path(spec["batches_file"])), data["lengths"], size, world_size)
    return {
        **_epoch(out["train_begin"], [s["time"] for s in steps], size, data),
        "setup_s": out["train_begin"] - t0,
        "same_batches_as_elastictrain": same,
    }


def same_batches(seen: list[dict[str, Any]], lengths: list[int], size: Size, world_size: int) -> bool:
    """Whether each rank's micro-batches held elastictrain's records (by length), in elastictrain's order:
    rank r's micro-batch j is global slice j * world + r (core/data_order.py)."""
    micro = size.micro_batch
    for rank in range(world_size):
        got = [b["lengths"] for b in seen if b["rank"] == rank]
        slices = [j * world_size + rank for j in range(size.records // (micro * world_size))]
        if got != [lengths[k * micro : (k + 1) * micro] for k in slices]:
            return False
    return True


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    size = SMOKE if smoke else FULL
    model_dir, data_dir = make_inputs(tmp / "sft", size)
    samples = tmp / "sft" / "samples.jsonl"
    data = write_samples(config(model_dir, data_dir, tmp / "sft" / "probe", size, 1), samples)
    if data["records"] != size.records:
        raise RuntimeError(
            f"sft: {data['records']} samples built, expected {size.records} (records dropped?)"
        )
    from benchmarks.peers.hf_trainer import ZERO3

    trainer_json = tmp / "sft" / "ds_z3_config.json"
    trainer_json.write_text(json.dumps(ZERO3))
    systems = ("elastictrain", "hf_trainer") if smoke else SYSTEMS
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for ws in size.world_sizes:
            for system in systems:  # interleaved: drift on a shared machine hits them alike
                where = tmp / "sft" / f"{system}-ws{ws}-rep{rep}"
                if system == "elastictrain":
                    r = run_ours(config(model_dir, data_dir, where, size, ws), size, data)
                elif system == "elastictrain_auto":
                    cfg = config(model_dir, data_dir, where, size, ws, "deepspeed.zero_stage=auto")
                    r = run_ours(cfg, size, data)
                elif system == "elastictrain_trainer_json":
                    cfg = config(
                        model_dir, data_dir, where, size, ws, f"deepspeed.config_file={trainer_json}"
                    )
                    r = run_ours(cfg, size, data)
                else:
                    deepspeed = system == "hf_trainer"
                    r = run_trainer(ws, size, model_dir, samples, data, where, deepspeed=deepspeed)
                runs.append({"rep": rep, "world_size": ws, "system": system, **r})
                print(
                    f"  sft rep {rep} ws {ws} {system}: {r['samples_per_s']:.2f} samples/s, "
                    f"{r['real_tokens_per_s']:.0f} real tokens/s (epoch {r['epoch_s']:.1f}s, "
                    f"set-up {r['setup_s']:.1f}s)",
                    flush=True,
                )
    metrics: dict[str, Any] = {
        "records": data["records"],
        "real_tokens": data["real_tokens"],
        # The Trainer padded the very micro-batches elastictrain did (checked by record lengths, per rank).
        "trainer_same_batches": all(
            r["same_batches_as_elastictrain"] for r in runs if r["system"] == "hf_trainer"
        ),
    }
    targets: list[Target] = []
    for ws in size.world_sizes:
        per = {s: [r for r in runs if r["world_size"] == ws and r["system"] == s] for s in systems}
        figures = {
            key: {s: median([r[key] for r in per[s]]) for s in systems}
            for key in ("samples_per_s", "real_tokens_per_s", "steady_samples_per_s", "setup_s")
        }

        def versus(
            system: str, peer: str = "hf_trainer", per: dict[str, list[dict[str, Any]]] = per
        ) -> float | None:
            """Per repetition (the same machine state), then their median."""
            pairs = [
                ratio(a["samples_per_s"], b["samples_per_s"])
                for a, b in zip(per[system], per[peer], strict=True)
            ]
            found = [p for p in pairs if p is not None]
            return median(found) if found else None

        vs = versus("elastictrain")
        metrics[f"ws{ws}"] = {**figures, "elastictrain_vs_trainer": vs}
        if "elastictrain_trainer_json" in systems:
            metrics[f"ws{ws}"]["elastictrain_trainer_json_vs_trainer"] = versus("elastictrain_trainer_json")
        targets.append(
            Target(f"sft ws{ws}: elastictrain / HF Trainer, samples/s over one epoch", vs, 1.0, ">=")
        )
        if "hf_trainer_default" in systems:
            auto = versus("elastictrain_auto", "hf_trainer_default")
            metrics[f"ws{ws}"]["elastictrain_auto_vs_trainer_default"] = auto
            metrics[f"ws{ws}"]["step_costs"] = {
                s: median([r["median_rest_s"] for r in per[s] if r.get("median_rest_s") is not None] or [0.0])
                for s in ("elastictrain", "elastictrain_auto")
            }
            targets.append(
                Target(
                    f"sft ws{ws}: elastictrain (auto layout) / HF Trainer without DeepSpeed, samples/s",
                    auto,
                    1.0,
                    ">=",
                )
            )
            targets.append(
                Target(
                    f"sft ws{ws}: elastictrain's time around the engine per step (median, auto layout)",
                    metrics[f"ws{ws}"]["step_costs"]["elastictrain_auto"],
                    0.010,
                    "<=",
                    unit="s",
                )
            )
    notes = [
        "One epoch of the same tokenized records in the same order and micro-batches, fp32, ZeRO-3 on CPU "
        "(gloo), one thread per rank; real tokens/s counts non-padding tokens (the same records, so its "
        "ratio is the samples/s ratio).",
        "HF Trainer: transformers' Trainer under torchrun with its DeepSpeed integration at ZeRO stage 3 "
        "(LLaMA-Factory's ds_z3_config.json), torch AdamW, padding per micro-batch (as "
        "DataCollatorForSeq2Seq).",
        "elastictrain, its defaults: ZeRO stage 3, in-memory snapshots with a buddy replica (every step at "
        "most, spaced to cost <= 3% of step time), its step pipeline; not its default: data.packing=false "
        "(padding per micro-batch, as the Trainer) instead of packed bins. One disk checkpoint, after the "
        "measured epoch; MLflow off.",
        "elastictrain_trainer_json: elastictrain given the Trainer's DeepSpeed JSON (deepspeed.config_file, "
        "its auto values filled in as the Trainer fills them: parameters above 10 x hidden elements "
        "partitioned and gathered, buckets of hidden^2). elastictrain's own config keeps DeepSpeed's "
        "persistence threshold (1e5 elements) and buckets of at least 4M elements: most of its lead is that "
        "config; this row is the rest.",
        "elastictrain_auto against hf_trainer_default: elastictrain with deepspeed.zero_stage=auto (ZeRO-0 "
        "in fp32 for this model) and its default threads (every core for one rank alone on the machine), "
        "against the Trainer without DeepSpeed (its default: DDP at 2 processes) with torch's default "
        "threads; step_costs: the median of each step's time outside the engine (data, the driver's round "
        "trip, metrics, snapshots), target 10 ms.",
        "Time: from ready-to-train (elastictrain: attempt started; Trainer: on_train_begin) to the last "
        "step's end. set-up_s is beside it, not in it: elastictrain from its launch on the already started "
        "local Ray cluster, the Trainer from torchrun's launch (imports included).",
    ]
    if smoke:
        notes.append("smoke: world size 2 and a tiny model only; not a measurement.")
    workload = {
        "model": {"model_type": "llama", "hidden_size": size.hidden, "num_hidden_layers": size.layers},
        "records": size.records,
        "cutoff_len": size.seq_len,
        "global_batch_size": size.global_batch,
        "micro_batch_size": size.micro_batch,
        "zero_stage": 3,
        "precision": "fp32",
        "packing": False,
    }
    return Result("sft", smoke, reps, metrics, targets, runs, notes, workload)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(k for k in result["metrics"] if k.startswith("ws"))
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, key, label in (
        (axes[0], "samples_per_s", "samples/s"),
        (axes[1], "real_tokens_per_s", "real tokens/s"),
    ):
        systems = list(result["metrics"][sizes[0]][key])
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            values = [result["metrics"][k][key][system] or 0 for k in sizes]
            ax.bar([j + i * width for j in range(len(sizes))], values, width, label=system)
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(sizes))],
            [k.replace("ws", "") + " process(es)" for k in sizes],
        )
        ax.set_ylabel(f"{label}, one epoch")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle("Instruction fine-tuning: elastictrain vs Hugging Face Trainer (ZeRO-3, CPU)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)
