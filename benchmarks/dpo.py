"""Preference training (DPO), one epoch: elastictrain against TRL's `DPOTrainer` (what LLaMA-Factory's DPO
stage runs), pairs/s and the final loss at 1 and 2 processes, LoRA and full fine-tune. Opt-in: `--only dpo`.

Both train the same pretrained model folder (a Llama made with transformers from a small config and its
ChatML tokenizer, examples/sft/prepare.py) on the same preference pairs (LLaMA-Factory sharegpt records
with `ranking: true`, made here: a word task's right answer chosen, its input words shuffled rejected),
for one epoch, fp32, ZeRO stage 3 on CPU with gloo, one thread per rank, the same global and micro batch
(of pairs: each micro-batch is its pairs' chosen rows then their rejected rows, right-padded to its
longest row), the same cutoff, optimizer, constant learning rate, gradient clipping, beta and sigmoid loss.
elastictrain reads them with `data.source: sft` and `training.objective: dpo`. TRL gets those very pairs,
encoded through the chat template and cut by elastictrain, in elastictrain's data order, read
sequentially, so both pad the same pairs together at every step (checked, by pair index, per rank);
it runs under torchrun with its DeepSpeed integration at stage 3 (LLaMA-Factory's ds_z3_config.json).

The reference model: with LoRA both take the model with its adapters off, inside each step. In a full
fine-tune elastictrain computes the starting model's log-probabilities of every pair once, before step 0
(its reference pass); the like-for-like TRL run does the same (precompute_ref_log_probs=True), and TRL's
default (a second, frozen ZeRO-3 copy of the model run inside every step) is measured beside it as
`trl_inline_ref`. Beside the LoRA defaults, both also run LoRA with the reference precomputed
(`elastictrain_ref_pass`: preference.reference=precomputed; `trl_precompute`), which tells what the
in-step reference costs each. The measured time is the epoch: from the moment each system is ready to train
(elastictrain: its workers set up and, in a full fine-tune, its reference pass done; TRL: on_train_begin,
after its engines, its reference precompute and its data loader) to the end of the last optimizer step.
Start-up and the reference pass are reported beside it.

TRL is not one of elastictrain's dependencies: where the environment lacks it, it is installed with pip
(`--no-deps`, into .bench-peers/trl, git-ignored) and put on the peer's PYTHONPATH only, so the
environment's pinned transformers, accelerate, datasets and peft are the ones both systems run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
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
    event_time,
    free_port,
    load,
    median,
    peer_env,
    ratio,
    record_steps,
    run_elastictrain,
)

PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "trl_dpo.py"
# The newest TRL when this benchmark was written; its requirements accept transformers >= 4.56.2.
TRL_VERSION = "1.16.0"
TRL_TARGET = ROOT / ".bench-peers" / "trl"
MODES = ("lora", "full")
# Each system's default first. Beside them, not in the smoke run: LoRA with the reference precomputed before
# training in both (elastictrain preference.reference=precomputed, TRL precompute_ref_log_probs=True), which
# tells the in-step reference's cost; TRL's default full fine-tune (a frozen copy run in every step).
SYSTEMS = {
    "lora": ("elastictrain", "trl", "elastictrain_ref_pass", "trl_precompute"),
    "full": ("elastictrain", "trl", "trl_inline_ref"),
}
# TRL's reference, by mode and system: precompute_ref_log_probs or not.
TRL_PRECOMPUTE = {
    ("lora", "trl"): False,
    ("lora", "trl_precompute"): True,
    ("full", "trl"): True,
    ("full", "trl_inline_ref"): False,
}


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    steps: int  # one epoch: pairs = steps x global batch
    global_batch: int  # pairs per optimizer step
    micro_batch: int  # pairs per micro-batch (twice as many rows)
    seq_len: int  # cutoff_len
    world_sizes: tuple[int, ...]
    timeout_s: float
    every_system: bool  # also the systems beside the defaults (SYSTEMS' 3rd and 4th)

    @property
    def pairs(self) -> int:
        return self.steps * self.global_batch


SMOKE = Size(
    hidden=64,
    layers=2,
    steps=2,
    global_batch=8,
    micro_batch=2,
    seq_len=128,
    world_sizes=(2,),
    timeout_s=240,
    every_system=False,
)
FULL = Size(
    hidden=256,
    layers=4,
    steps=24,
    global_batch=16,
    micro_batch=4,
    seq_len=128,
    world_sizes=(1, 2),
    timeout_s=600,
    every_system=True,
)
LR = {"lora": 2e-3, "full": 5e-4}  # constant (no warm-up) in both systems: the same rate at every step
BETAS, GRAD_CLIP, SEED, BETA = (0.9, 0.95), 1.0, 42, 0.1
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}  # every linear layer but the output head


# ---------------------------------------------------------------- TRL
@dataclass(frozen=True)
class Trl:
    path: Path | None  # put on the peer's PYTHONPATH; None: the environment's own
    version: str
    where: str


def locate_trl(install: bool = True) -> Trl | str:
    """TRL for the peer (the environment's, else .bench-peers/trl, installed there if missing), or why not."""
    if importlib.util.find_spec("trl") is not None:
        import trl

        return Trl(None, trl.__version__, f"the environment's ({Path(trl.__file__).parent})")
    if importlib.util.find_spec("peft") is None:
        return "peft is not installed in this environment (the LoRA runs need it in both systems)"
    if not (TRL_TARGET / "trl" / "__init__.py").exists():
        if not install:
            return f"trl is not installed (neither in this environment nor in {TRL_TARGET})"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_TARGET)]
        try:
            proc = subprocess.run([*cmd, f"trl=={TRL_VERSION}"], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"pip install trl=={TRL_VERSION} --target {TRL_TARGET}: no answer in 300 s"
        if proc.returncode != 0:
            return f"pip install trl=={TRL_VERSION} --target {TRL_TARGET} failed: {proc.stderr[-600:]}"
    env = {**os.environ, "PYTHONPATH": _pythonpath(TRL_TARGET, os.environ.get("PYTHONPATH"))}
    probe = "import trl; from trl import DPOConfig, DPOTrainer; print(trl.__version__)"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, env=env
        )
    except subprocess.TimeoutExpired:
        return f"trl from {TRL_TARGET} did not import within 180 s"
    if proc.returncode != 0:
        return (
            f"trl from {TRL_TARGET} does not import with this environment's packages "
            f"(transformers, accelerate, datasets): {proc.stderr.strip()[-600:]}"
        )
    return Trl(TRL_TARGET, proc.stdout.strip().splitlines()[-1], f"{TRL_TARGET} (pip --no-deps --target)")


def _pythonpath(first: Path, rest: str | None) -> str:
    return str(first) + (os.pathsep + rest if rest else "")


# ---------------------------------------------------------------- inputs
def _prepare_module() -> Any:
    spec = importlib.util.spec_from_file_location("sft_prepare", ROOT / "examples" / "sft" / "prepare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rejected(rng: random.Random, query: str, answer: str) -> str:
    """A wrong answer to a word task, one that ignores the instruction: the input's words, shuffled."""
    words = query.split()
    for _ in range(20):
        candidate = " ".join(rng.sample(words, len(words)))
        if candidate != answer:
            return candidate
    return f"{answer} {words[0]}"


def pair_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n LLaMA-Factory sharegpt ranking records: a word task, its right answer chosen, its input shuffled
    rejected; a quarter with a system prompt, a fifth with a turn of history before the question."""
    prepare = _prepare_module()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        convo = [{"from": "system", "value": prepare.SYSTEM}] if i % 4 == 1 else []
        if i % 5 == 3:
            instruction, query, answer = prepare._task(rng)
            convo += [{"from": "human", "value": f"{instruction}\n{query}"}, {"from": "gpt", "value": answer}]
        instruction, query, answer = prepare._task(rng)
        convo.append({"from": "human", "value": f"{instruction}\n{query}"})
        out.append(
            {
                "conversations": convo,
                "chosen": {"from": "gpt", "value": answer},
                "rejected": {"from": "gpt", "value": _rejected(rng, query, answer)},
            }
        )
    return out


def make_inputs(tmp: Path, size: Size) -> tuple[Path, Path]:
    """The pretrained model folder (with its ChatML tokenizer) and the pairs' dataset_info.json folder."""
    prepare = _prepare_module()
    model_dir, data_dir = tmp / "inputs" / "model", tmp / "inputs" / "data"
    tokenizer = prepare.build_tokenizer(model_dir)
    prepare.build_base_model(tokenizer, model_dir, hidden=size.hidden, layers=size.layers)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "word_pairs.json").write_text(json.dumps(pair_records(size.pairs), indent=1))
    info = {
        "word_pairs": {
            "file_name": "word_pairs.json",
            "formatting": "sharegpt",
            "ranking": True,
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
        }
    }
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return model_dir, data_dir


def config(
    model_dir: Path, data_dir: Path, run_dir: Path, size: Size, world_size: int, mode: str, *extra: str
) -> Any:
    lora = (
        [
            "model.lora.enabled=true",
            f"model.lora.r={LORA['r']}",
            f"model.lora.alpha={LORA['alpha']}",
            f"model.lora.target_modules={LORA['target_modules']}",
        ]
        if mode == "lora"
        else []
    )
    return load(
        [
            f"run.dir={run_dir}",
            f"model.pretrained={model_dir}",
            *lora,
            "data.source=sft",
            f"data.dataset_dir={data_dir}",
            "data.dataset=word_pairs",
            f"data.seq_len={size.seq_len}",
            "training.objective=dpo",
            "preference.dpo_loss=sigmoid",
            f"preference.beta={BETA}",
            "training.num_epochs=1",
            "training.lr_schedule=constant",
            "training.warmup_steps=0",
            f"training.global_batch_size={size.global_batch}",
            f"training.micro_batch_size={size.micro_batch}",
            "training.precision=fp32",
            f"training.lr={LR[mode]}",
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


def write_pairs(cfg: Any, folder: Path) -> dict[str, Any]:
    """elastictrain's pairs of the epoch, encoded and cut, in its data order, as an Arrow dataset for TRL
    ({index, prompt_ids, chosen_ids, rejected_ids}); returns the order and the counts."""
    from datasets import Dataset, disable_progress_bars

    from elastictrain.core.data_order import epoch_permutation
    from elastictrain.data.sources import dataset_from_config

    dataset = dataset_from_config(cfg)
    rows, tokens = [], 0
    order = list(epoch_permutation(len(dataset), cfg.training.seed, 0))
    for i in order:
        prompt, chosen, rejected = dataset.rows(i)
        rows.append({"index": i, "prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
        tokens += 2 * len(prompt) + len(chosen) + len(rejected)
    disable_progress_bars()
    Dataset.from_list(rows).save_to_disk(str(folder))
    return {"pairs": len(dataset), "real_tokens": tokens, "order": order, "pad_id": dataset.pad_token_id}


# ---------------------------------------------------------------- runs
def _epoch(ready: float, step_times: list[float], size: Size, pairs: int) -> dict[str, Any]:
    seconds = step_times[-1] - ready
    steady = step_times[-1] - step_times[0]  # the first step (one-time costs of both) left out
    return {
        "epoch_s": seconds,
        "steps": len(step_times),
        "pairs_per_s": pairs / seconds,
        "steady_pairs_per_s": (pairs - size.global_batch) / steady if steady > 0 else None,
    }


def run_ours(cfg: Any, size: Size, data: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.baselines import ensure_local_ray
    from elastictrain.core.losses import preference_figures, replica_results, step_loss
    from elastictrain.driver.launch import resolve_length

    ensure_local_ray()
    resolve_length(cfg)  # training.num_epochs -> max_steps, as `elastictrain train` does
    assert cfg.training.max_steps == size.steps, (cfg.training.max_steps, size.steps)
    steps: list[dict[str, Any]] = []
    figures: list[dict[str, float]] = []
    begin: list[float] = []
    t0 = time.time()

    def losses(_controller: Any, _index: int, results: list[dict[str, Any]]) -> None:
        replicas = replica_results(results)
        fb = max(float(r.get("forward_backward_s") or 0.0) for r in results)
        figures.append(
            {"loss": step_loss(replicas), "forward_backward_s": fb, **preference_figures(replicas)}
        )

    def hook(controller: Any) -> None:
        record_steps(steps)(controller)
        controller.callbacks.after_step.append(losses)
        controller.callbacks.after_attempt_start.append(lambda _c: begin.append(time.time()))

    run_dir = run_elastictrain(cfg, hook)
    events = run_dir.read_events()
    done = [e for e in events if e["event"] == "reference_done"]
    # A full fine-tune's reference pass runs after the attempt started, before step 0: beside the epoch.
    ready = max(begin[0], event_time(done[0])) if done else begin[0]
    later = slice(1, None)  # the first step's one-time costs left out
    return {
        **_epoch(ready, [s["time"] for s in steps], size, data["pairs"]),
        # Where a step's time goes (medians): the driver's wall clock per step, the slowest rank's step
        # and, within it, its forward and backward passes (the rest: the optimizer's update, snapshots).
        "step_s_median": median([s["step_s"] for s in steps][later]),
        "rank_step_s_median": median([s["rank_step_s"] for s in steps][later]),
        "forward_backward_s_median": median([f["forward_backward_s"] for f in figures][later]),
        "setup_s": begin[0] - t0,
        "ref_s": ready - begin[0],
        "reference": "precomputed (reference pass)" if done else "adapters off, in the step",
        "losses": [f["loss"] for f in figures],
        "final_loss": figures[-1]["loss"],
        "final_margin": figures[-1].get("rewards/margins"),
        "final_accuracy": figures[-1].get("rewards/accuracies"),
    }


def run_trl(
    trl: Trl,
    mode: str,
    precompute: bool,
    world_size: int,
    size: Size,
    model_dir: Path,
    pairs_cfg: Any,
    data: dict[str, Any],
    tmp: Path,
) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    dataset_dir = tmp / "pairs"  # a fresh copy per run: TRL caches precomputed references beside it
    write_pairs(pairs_cfg, dataset_dir)
    spec = {
        "model_dir": str(model_dir),
        "dataset_dir": str(dataset_dir),
        "micro_batch_size": size.micro_batch,
        "grad_accum_steps": size.global_batch // (size.micro_batch * world_size),
        "lr": LR[mode],
        "adam_betas": list(BETAS),
        "grad_clip": GRAD_CLIP,
        "seed": SEED,
        "beta": BETA,
        "max_length": size.seq_len,
        "precompute_ref": precompute,
        "lora": LORA if mode == "lora" else None,
        "output_dir": str(tmp / "trl-out"),
        "steps_file": str(tmp / "steps.jsonl"),
        "out": str(tmp / "out.json"),
        "batches_file": str(tmp / "batches.jsonl"),
    }
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    cmd = [
        str(BIN / "torchrun"), f"--nproc-per-node={world_size}", "--nnodes=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=dpo{port}",
        str(PEER_SCRIPT), "--spec", str(spec_path),
    ]  # fmt: skip
    env = peer_env()
    if trl.path is not None:
        env["PYTHONPATH"] = _pythonpath(trl.path, env.get("PYTHONPATH"))
    # Nothing downloaded or reported: the model and the data are local.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TQDM_DISABLE="1")
    t0 = time.time()
    log_path = tmp / "log.txt"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=size.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
    _remove_shm(port)
    out = _read_json(Path(spec["out"]))
    lines = _read_lines(Path(spec["steps_file"]))
    steps = [s for s in lines if "event" not in s]
    logs = [s for s in lines if s.get("event") == "log"]
    if proc.returncode != 0 or out is None or len(steps) != size.steps:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"TRL DPOTrainer ({mode}) at {world_size} process(es): exit {proc.returncode}; log tail:\n{tail}"
        )
    if out["deepspeed"] != "DeepSpeedEngine" or out["world_size"] != world_size:
        raise RuntimeError(f"TRL ran as {out['deepspeed']} at world size {out['world_size']}")
    seen = _read_lines(Path(spec["batches_file"]))
    times = [out["train_begin"]] + [s["time"] for s in steps]
    return {
        **_epoch(out["train_begin"], [s["time"] for s in steps], size, data["pairs"]),
        "step_s_median": median([b - a for a, b in zip(times, times[1:], strict=False)][1:]),
        "setup_s": out["train_begin"] - t0 - out["ref_s"],
        "ref_s": out["ref_s"],
        "reference": out["reference"],
        "trainable_parameters": out["trainable_parameters"],
        "losses": [s["loss"] for s in logs],
        "final_loss": logs[-1]["loss"] if logs else None,
        "final_margin": logs[-1].get("rewards/margins") if logs else None,
        "final_accuracy": logs[-1].get("rewards/accuracies") if logs else None,
        "same_batches_as_elastictrain": same_batches(seen, data["order"], size, world_size),
    }


def same_batches(seen: list[dict[str, Any]], order: list[int], size: Size, world_size: int) -> bool:
    """Whether each rank's micro-batches held elastictrain's pairs, in elastictrain's order: rank r's
    micro-batch j is global slice j * world + r (core/data_order.py)."""
    micro = size.micro_batch
    for rank in range(world_size):
        got = [b["indices"] for b in seen if b["rank"] == rank]
        slices = [j * world_size + rank for j in range(size.pairs // (micro * world_size))]
        if got != [order[k * micro : (k + 1) * micro] for k in slices]:
            return False
    return True


def _by_rep(
    per: dict[str, list[dict[str, Any]]], system: str, ours: str = "elastictrain", *, with_pass: bool = False
) -> list[float]:
    """`ours`' pairs/s over `system`'s, per repetition (the same machine state); with `with_pass`, each
    system's reference pass counted in its time."""
    out = []
    for a, b in zip(per[ours], per[system], strict=True):
        extra = (a["ref_s"], b["ref_s"]) if with_pass else (0.0, 0.0)
        found = ratio(b["epoch_s"] + extra[1], a["epoch_s"] + extra[0])
        if found is not None:
            out.append(found)
    return out


def _med(values: list[float]) -> float | None:
    return median(values) if values else None


def _max_difference(a: list[float], b: list[float]) -> float | None:
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- the benchmark
def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    size = SMOKE if smoke else FULL
    workload = {
        "model": {"model_type": "llama", "hidden_size": size.hidden, "num_hidden_layers": size.layers},
        "pairs": size.pairs,
        "cutoff_len": size.seq_len,
        "global_batch_size_pairs": size.global_batch,
        "micro_batch_size_pairs": size.micro_batch,
        "zero_stage": 3,
        "precision": "fp32",
        "dpo_loss": "sigmoid",
        "beta": BETA,
        "lr": LR,
        "lr_schedule": "constant",
        "lora": LORA,
    }
    trl = locate_trl()
    if isinstance(trl, str):
        print(f"  dpo: skipped, TRL unavailable: {trl}", flush=True)
        notes = [
            f"Not measured: TRL's DPOTrainer is unavailable here ({trl}); elastictrain was not run alone."
        ]
        targets = [
            Target(
                f"dpo {mode} ws{ws}: elastictrain / TRL DPOTrainer, pairs/s over one epoch", None, 1.0, ">="
            )
            for mode in MODES
            for ws in size.world_sizes
        ]
        return Result("dpo", smoke, reps, {"trl_unavailable": trl}, targets, [], notes, workload)

    model_dir, data_dir = make_inputs(tmp / "dpo", size)
    probe = config(model_dir, data_dir, tmp / "dpo" / "probe", size, 1, "full")
    data = write_pairs(probe, tmp / "dpo" / "pairs-probe")
    if data["pairs"] != size.pairs:
        raise RuntimeError(f"dpo: {data['pairs']} pairs built, expected {size.pairs} (pairs dropped?)")
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for ws in size.world_sizes:
            for mode in MODES:
                systems = SYSTEMS[mode] if size.every_system else SYSTEMS[mode][:2]
                for system in systems:  # interleaved: drift on a shared machine hits them alike
                    where = tmp / "dpo" / f"{mode}-{system}-ws{ws}-rep{rep}"
                    if system.startswith("elastictrain"):
                        extra = ["preference.reference=precomputed"] if system.endswith("ref_pass") else []
                        cfg = config(model_dir, data_dir, where, size, ws, mode, *extra)
                        r = run_ours(cfg, size, data)
                    else:
                        precompute = TRL_PRECOMPUTE[mode, system]
                        r = run_trl(trl, mode, precompute, ws, size, model_dir, probe, data, where)
                    runs.append({"rep": rep, "world_size": ws, "mode": mode, "system": system, **r})
                    print(
                        f"  dpo rep {rep} ws {ws} {mode} {system}: {r['pairs_per_s']:.2f} pairs/s "
                        f"(epoch {r['epoch_s']:.1f}s, set-up {r['setup_s']:.1f}s, reference "
                        f"{r['ref_s']:.1f}s), final loss {r['final_loss']:.4f}",
                        flush=True,
                    )
    metrics: dict[str, Any] = {
        "pairs": data["pairs"],
        "real_tokens": data["real_tokens"],
        "trl_version": trl.version,
        # TRL trained the very micro-batches elastictrain did (checked by pair index, per rank).
        "trl_same_batches": all(
            r["same_batches_as_elastictrain"] for r in runs if not r["system"].startswith("elastictrain")
        ),
    }
    targets: list[Target] = []
    for mode in MODES:
        systems = SYSTEMS[mode] if size.every_system else SYSTEMS[mode][:2]
        metrics[mode] = {}
        for ws in size.world_sizes:
            per = {
                s: [r for r in runs if (r["world_size"], r["mode"], r["system"]) == (ws, mode, s)]
                for s in systems
            }
            figures = {
                key: {s: median([r[key] for r in per[s] if r[key] is not None]) for s in systems}
                for key in ("pairs_per_s", "steady_pairs_per_s", "epoch_s", "setup_s", "ref_s", "final_loss")
            }

            reps_vs = _by_rep(per, "trl")
            vs = _med(reps_vs)
            row: dict[str, Any] = {
                **figures,
                "elastictrain_vs_trl": vs,
                "elastictrain_vs_trl_by_rep": {f"rep{i}": x for i, x in enumerate(reps_vs)},
                # The largest difference between the two systems' loss at the same step (rep 0).
                "max_loss_difference": max(
                    _max_difference(per["elastictrain"][0]["losses"], per[s][0]["losses"]) or 0.0
                    for s in systems[1:]
                ),
                # elastictrain's steps (medians over its runs): the driver's wall clock, the slowest rank's
                # step and, within it, the forward and backward passes; TRL's step for comparison.
                "elastictrain_step_s": median([r["step_s_median"] for r in per["elastictrain"]]),
                "elastictrain_rank_step_s": median([r["rank_step_s_median"] for r in per["elastictrain"]]),
                "elastictrain_forward_backward_s": median(
                    [r["forward_backward_s_median"] for r in per["elastictrain"]]
                ),
                "trl_step_s": median([r["step_s_median"] for r in per["trl"]]),
            }
            if "trl_inline_ref" in per:
                row["elastictrain_vs_trl_inline_ref"] = _med(_by_rep(per, "trl_inline_ref"))
                row["elastictrain_with_reference_pass_vs_trl_inline_ref"] = _med(
                    _by_rep(per, "trl_inline_ref", with_pass=True)
                )
            if mode == "full":
                row["elastictrain_with_reference_pass_vs_trl_with_precompute"] = _med(
                    _by_rep(per, "trl", with_pass=True)
                )
            if "trl_precompute" in per:
                # LoRA with the reference precomputed in both: the steps without the in-step reference.
                row["elastictrain_ref_pass_vs_trl_precompute"] = _med(
                    _by_rep(per, "trl_precompute", "elastictrain_ref_pass")
                )
                # What the in-step reference (adapters off, a forward without gradients) adds to a step:
                # each system's median step with it less its median step with the reference precomputed.
                row["in_step_reference_s"] = {
                    "elastictrain": row["elastictrain_step_s"]
                    - median([r["step_s_median"] for r in per["elastictrain_ref_pass"]]),
                    "trl": row["trl_step_s"] - median([r["step_s_median"] for r in per["trl_precompute"]]),
                }
            metrics[mode][f"ws{ws}"] = row
            name = f"dpo {mode} ws{ws}: elastictrain / TRL DPOTrainer, pairs/s over one epoch"
            targets.append(
                Target(name, vs, 1.0, ">=", note=_miss_note(mode, ws, row) if vs and vs < 1 else "")
            )
    return Result("dpo", smoke, reps, metrics, targets, runs, _notes(trl, size, smoke), workload)


def _miss_note(mode: str, ws: int, row: dict[str, Any]) -> str:
    """What the runs measured of a missed target: the ratio per repetition and where elastictrain's step
    time went."""
    spread = ", ".join(f"{x:.2f}" for x in row["elastictrain_vs_trl_by_rep"].values())
    step, rank, fb = (
        row["elastictrain_step_s"],
        row["elastictrain_rank_step_s"],
        row["elastictrain_forward_backward_s"],
    )
    out = (
        f"dpo {mode} ws{ws} missed: elastictrain / TRL per repetition {spread}. elastictrain's median step "
        f"{step:.3f}s on the driver's clock, {rank:.3f}s on its slowest rank, {fb:.3f}s of that in the "
        f"forward and backward passes ({fb / step:.0%} of the step; the driver, the update and snapshots the "
        f"rest); TRL's median step {row['trl_step_s']:.3f}s."
    )
    if "in_step_reference_s" in row:
        ref = row["in_step_reference_s"]
        out += (
            " With the reference precomputed in both, elastictrain / TRL is "
            f"{row['elastictrain_ref_pass_vs_trl_precompute']:.2f}x: the in-step reference (the model with "
            f"its adapters off, a forward without gradients under ZeRO-3) adds {ref['elastictrain']:.3f}s to "
            f"elastictrain's median step and {ref['trl']:.3f}s to TRL's."
        )
    return out


def _notes(trl: Trl, size: Size, smoke: bool) -> list[str]:
    notes = [
        f"TRL {trl.version} from {trl.where}, run under torchrun with the Trainer's DeepSpeed integration at "
        "ZeRO stage 3 (LLaMA-Factory's ds_z3_config.json), torch AdamW, fp32 (DPOConfig's bf16 default off), "
        "gradient checkpointing off (DPOConfig's default on; elastictrain's off), dropout off in both, "
        "logging every step. Its dataset preparation is skipped: it is given elastictrain's encoded pairs "
        "(prompt, chosen and rejected token ids) in elastictrain's order; its collator, loss, reference "
        "handling and training loop are its own.",
        "One epoch of the same pairs in the same order and micro-batches (a micro-batch of B pairs is 2B "
        "rows, right-padded to its longest), sigmoid DPO loss, beta 0.1, constant learning rate (LoRA "
        f"{LR['lora']}, full {LR['full']}), no warm-up, gradient clipping {GRAD_CLIP}, one thread per rank. "
        f"LoRA: r {LORA['r']}, alpha {LORA['alpha']}, {LORA['target_modules']} in both.",
        "Reference: with LoRA both run the model with its adapters off inside each step (their defaults); "
        "beside them, elastictrain_ref_pass (preference.reference=precomputed) and trl_precompute "
        "(precompute_ref_log_probs=True) compute the starting model's log-probabilities before training, "
        "and in_step_reference_s is what the in-step reference adds to each one's median step. Full "
        "fine-tune: "
        "elastictrain's reference pass computes the starting model's log-probabilities of every pair before "
        "step 0 (ref_s: from its workers' set-up to the pass's end, not in the epoch); `trl` is TRL with "
        "precompute_ref_log_probs=True (the same, before on_train_begin, in ref_s); `trl_inline_ref` is "
        "TRL's default, a second, frozen ZeRO-3 copy of the model run in every step (its reference cost is "
        "in its epoch). The with_reference_pass ratios count each system's pass in its time.",
        "Time: from ready-to-train (elastictrain: attempt started and, full fine-tune, its reference pass "
        "done; TRL: on_train_begin) to the last step's end. setup_s is beside it: elastictrain from its "
        "launch on the already started local Ray cluster, TRL from torchrun's launch (imports included) less "
        "its reference precompute.",
        "elastictrain, its defaults: ZeRO stage 3, in-memory snapshots with a buddy replica (spaced to cost "
        "<= 3% of step time), its step pipeline; one disk checkpoint after the measured epoch; MLflow off.",
        "final_loss: each system's loss of the last step (the mean over its global batch of pairs); "
        "max_loss_difference: the largest difference between the two systems' losses at the same step.",
    ]
    if smoke:
        notes.append("smoke: world size 2, a tiny model and 2 steps only; not a measurement.")
    return notes


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    modes = [m for m in MODES if isinstance(result["metrics"].get(m), dict)]
    for ax, mode in zip(axes[:2], MODES, strict=True):
        ax.set_title(f"{mode}: pairs/s over one epoch", fontsize=9)
        if mode not in modes:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            continue
        sizes = sorted(result["metrics"][mode])
        systems = list(result["metrics"][mode][sizes[0]]["pairs_per_s"])
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            values = [result["metrics"][mode][k]["pairs_per_s"][system] or 0 for k in sizes]
            ax.bar([j + i * width for j in range(len(sizes))], values, width, label=system)
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(sizes))],
            [k.replace("ws", "") + " process(es)" for k in sizes],
        )
        ax.set_ylabel("pairs/s")
        ax.legend(fontsize=7)
    ax = axes[2]
    ax.set_title("loss per step (1st repetition, fewest processes)", fontsize=9)
    for mode, color in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
        rows = [r for r in result["runs"] if r["mode"] == mode and r["rep"] == 0]
        if not rows:
            continue
        ws = min(r["world_size"] for r in rows)
        for r in rows:
            if r["world_size"] == ws and r["system"] in ("elastictrain", "trl"):
                style = "-" if r["system"] == "elastictrain" else "--"
                ax.plot(
                    range(1, len(r["losses"]) + 1),
                    r["losses"],
                    style,
                    color=color,
                    label=f"{mode} {r['system']}",
                )
    ax.set_xlabel("step")
    ax.set_ylabel("DPO loss")
    ax.legend(fontsize=7)
    fig.suptitle("Preference training (DPO): elastictrain vs TRL DPOTrainer (ZeRO-3, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
