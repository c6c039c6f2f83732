"""Part f: checkpoints move between devices: saved on CPU at world size 2, loaded on the GPU at world
size 1 in bf16, and the reverse (docs/gpu-check-cross-device.md).

    python -m benchmarks.gpu_check.cross_device prepare --dest .gpu-kit/cpu-checkpoint
    python -m benchmarks.gpu_check.cross_device load --archive benchmarks/results/gpu-checkpoint.tar.gz

`prepare` (CPU, fp32, gloo, 2 workers on Ray, conf/tiny-cpu.yaml's model) trains K steps with a
checkpoint at K, copies that run folder to DEST/run, resumes the original one more step and writes that
step's loss to DEST/expected.json. `run` resumes a copy of DEST/run on the device (1 worker, the
profile's precision) for steps K+1 (compared with the CPU's) and K+2 (checkpoint), copies that folder,
resumes it for K+3, and packs the copy with the device's loss of K+3 into OUT/gpu-checkpoint.tar.gz for
`load_on_cpu` (CPU, fp32, 2 workers). Every move is `elastictrain resume` of a run folder at a new path
with `key=value` changes, as a user makes it. The first loss after a load is the forward pass of the
loaded weights on the batch at the saved data position, before any update: it tests the load alone,
whichever steps follow (so K+1 and K+2 share one run: an engine build less on the device's clock).

Tolerance, bf16 against fp32: u x |loss|, u = 2^-8 being bf16's unit roundoff: the loss is allowed the
accuracy of one bf16 number, as if the whole forward pass had been rounded once. Measured here on CPU
(DeepSpeed's CPU accelerator in bf16) from the same checkpoints, the differences are 12 to 50 times
smaller (3.6e-4 at step 5, 1.5e-3 at step 7, against 0.018): the roundings of weights and activations
are of either sign and largely cancel; the margin is for the GPU's other kernels (fused attention, other
accumulation orders). It is 7 times below the loss's move in the step before the checkpoint (0.13) and
45 times below the distance to a fresh model's (5.54 against 4.69), so a checkpoint not loaded, or one
of another step, fails it; the move is recorded beside it. fp32 against fp32 (the dry profile) differs
only in summation order (2 workers against 1): 10 fp32 ulps of the loss, as in numerics.py.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check import runs
from benchmarks.gpu_check.profile import DRY, ROOT, TINY, Profile

K = 4  # steps trained on CPU before the checkpoint that moves
# keep_warm_s: each of the part's runs (one driver) takes the warm workers of the run before it.
SETTING = (
    "data.generated_chars=60000",
    "training.warmup_steps=2",
    "checkpoint.memory_every_steps=0",
    "scaling.keep_warm_s=60",
)
KIT = ROOT / os.environ.get("GPU_KIT", ".gpu-kit") / "cpu-checkpoint"  # as `make gpu-kit` leaves it
ARCHIVE = "gpu-checkpoint.tar.gz"
RECORD = "gpu-checkpoint.json"
ARCHIVE_LIMIT_BYTES = 8 * 2**20
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_EPS = float(torch.finfo(torch.float32).eps)
# What `elastictrain resume` reads from a run folder; the rest (MLflow store, plots, spool) stays.
RESUME_NEEDS = ("run.json", "config.yaml", "events.jsonl")  # and the checkpoint it loads


def tolerance(loss: float, precisions: set[str]) -> float:
    """The largest difference allowed between two first losses after loading the same checkpoint."""
    if precisions == {"fp32"}:
        return 10 * FP32_EPS * abs(loss)
    return BF16_UNIT_ROUNDOFF * abs(loss)


def versions() -> dict[str, str]:
    import deepspeed

    from elastictrain.version import __version__

    cuda = torch.version.cuda or "none"
    return {
        "elastictrain": __version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cuda": cuda,
        "python": platform.python_version(),
    }


def copy_run(src: Path, dest: Path) -> Path:
    """A run folder at a new path holding what a resume reads: run.json, config.yaml, the events and the
    newest committed checkpoint with its `latest` pointer (older ones and unfinished saves stay)."""
    from elastictrain.checkpoint.store import CheckpointStore

    newest = CheckpointStore(src / "checkpoints").latest_committed()
    if newest is None:
        raise RuntimeError(f"{src} holds no committed checkpoint")
    dest.mkdir(parents=True)
    for name in RESUME_NEEDS:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    shutil.copytree(newest.path, dest / "checkpoints" / newest.tag)
    (dest / "checkpoints" / "latest").write_text(newest.tag + "\n")
    return dest


def resume(path: Path, *overrides: str) -> dict[str, Any]:
    """`elastictrain resume PATH key=value...` from Python as cli.resume does it (the run's lock, its
    config.yaml with the changes a resume allows, recorded), tracking off; each completed step's loss."""
    from elastictrain.config import load_config
    from elastictrain.control.progress import Reporter
    from elastictrain.core.losses import step_loss
    from elastictrain.driver.launch import apply_resume_changes, check_before_start, run_training
    from elastictrain.rundir.lock import RunLock
    from elastictrain.rundir.run_dir import RunDir

    steps: list[dict[str, Any]] = []

    def after_step(controller: Any, index: int, results: list[dict[str, Any]]) -> None:
        steps.append({"step": index + 1, "loss": step_loss(results)})

    t0 = time.perf_counter()
    with RunLock(path):
        run_dir = RunDir.open(path)
        cfg = load_config(run_dir.config_yaml, list(overrides))
        changes = apply_resume_changes(run_dir, cfg)
        check_before_start(cfg)
        summary = run_training(
            cfg,
            run_dir,
            tracking=False,
            reporter=Reporter(cfg.training.max_steps, stream=sys.stdout, live=False),
            controller_hook=lambda c: c.callbacks.after_step.append(after_step),
        )
    if summary.status.value != "FINISHED":
        raise RuntimeError(f"resume of {path} ended {summary.status.value}: {summary.message}")
    return {"steps": steps, "changes": changes, "wall_s": round(time.perf_counter() - t0, 1)}


def _loss_of(result: dict[str, Any], step: int) -> float:
    found = [s["loss"] for s in result["steps"] if s["step"] == step]
    if not found:
        raise RuntimeError(f"no loss for step {step}: steps {[s['step'] for s in result['steps']]}")
    return float(found[-1])


def prepare(dest: Path, work: Path | None = None) -> dict[str, Any]:
    """On CPU (fp32, gloo, 2 workers on Ray): DEST/run holding the checkpoint at step K only, and
    DEST/expected.json with the CPU's loss of step K+1 from that checkpoint."""
    scratch = work is None
    work = work or Path(tempfile.mkdtemp(prefix="elastictrain-cross-device-"))
    t0 = time.perf_counter()
    original = work / "cpu-run"
    cfg = runs.config(
        DRY, TINY, original, *SETTING, f"training.max_steps={K}", f"checkpoint.every_steps={K}", workers=2
    )
    trained = runs.train(cfg)
    if dest.exists():
        shutil.rmtree(dest)
    copy_run(original, dest / "run")
    nxt = resume(original, f"training.max_steps={K + 1}")
    expected = {
        "step": K + 1,
        "loss": _loss_of(nxt, K + 1),
        "losses_before": [s["loss"] for s in trained["steps"]],
        "checkpoint_step": K,
        "made_by": f"conf/tiny-cpu.yaml {' '.join(SETTING)}: {K} steps on CPU, fp32, gloo, 2 workers on "
        f"Ray, checkpoint at step {K}; the loss of step {K + 1} after resuming it the same way",
        "device": "cpu",
        "precision": "fp32",
        "world_size": 2,
        "versions": versions(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (dest / "expected.json").write_text(json.dumps(expected, indent=1))
    if scratch:
        shutil.rmtree(work, ignore_errors=True)
    return expected


def _device_name(profile: Profile) -> str:
    return torch.cuda.get_device_name(0) if profile.use_gpu and torch.cuda.is_available() else "cpu"


def _source(ctx: Any) -> Path:
    """The CPU's checkpoint: the kit's (made before the GPU machine started) or one made here now."""
    if ctx.profile.use_gpu and (KIT / "expected.json").is_file():
        ctx.record("prepared", {"made_here": False, "from": str(KIT)})
        return KIT
    why = "the dry profile" if not ctx.profile.use_gpu else f"no {KIT} in the kit"
    source = ctx.work / "cpu-checkpoint"
    expected = prepare(source, ctx.work / "prepare")
    ctx.record("prepared", {"made_here": True, "why": why, "seconds": expected["seconds"]})
    return source


def run(ctx: Any) -> None:
    p = ctx.profile
    source = _source(ctx)
    expected = json.loads((source / "expected.json").read_text())
    k = int(expected["checkpoint_step"])
    ctx.record("cpu", expected)
    run_path = copy_run(source / "run", ctx.work / "run")
    on_device = (*p.scaling(1), f"training.precision={p.precision}")
    # Steps K+1 (the compared one: the forward pass of the loaded weights) and K+2, then a checkpoint.
    first = resume(run_path, *on_device, f"training.max_steps={k + 2}", f"checkpoint.every_steps={k + 2}")
    loss, cpu_loss = _loss_of(first, k + 1), float(expected["loss"])
    tol = tolerance(cpu_loss, {p.precision, str(expected["precision"])})
    move = abs(float(expected["losses_before"][-1]) - cpu_loss)
    ctx.record(
        "device_load",
        {
            "loss": loss,
            "cpu_loss": cpu_loss,
            "difference": abs(loss - cpu_loss),
            "tolerance": tol,
            "one_step_move": move,
            "changes": first["changes"],
            "wall_s": first["wall_s"],
        },
    )
    ctx.target(
        f"cross_device: loss of step {k + 1} on {p.device} ({p.precision}, 1 worker) from the CPU's "
        f"checkpoint at step {k}, difference from the CPU's (fp32, 2 workers)",
        abs(loss - cpu_loss),
        tol,
        "<=",
        note=("bf16's unit roundoff x the loss" if p.precision == "bf16" else "10 fp32 ulps of the loss")
        + f"; the loss moved {move:.3g} in the step before the checkpoint",
    )
    packed = copy_run(run_path, ctx.work / "packed" / "run")  # the device's checkpoint at step K+2
    last = resume(run_path, f"training.max_steps={k + 3}")
    record = {
        "device": _device_name(p),
        "precision": p.precision,
        "world_size": 1,
        "step": k + 2,
        "next_step": k + 3,
        "loss": _loss_of(last, k + 3),
        "cpu_checkpoint": expected["made_by"],
        "versions": versions(),
    }
    archive = pack(packed, record, ctx.out / ARCHIVE)
    size = archive.stat().st_size
    ctx.record("archive", {"path": str(archive), "bytes": size, **record})
    ctx.target("cross_device: gpu-checkpoint.tar.gz size (bytes)", size, ARCHIVE_LIMIT_BYTES, "<=")


def pack(run_path: Path, record: dict[str, Any], archive: Path) -> Path:
    """run/ (what a resume reads) and gpu-checkpoint.json, gzipped."""
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(run_path, arcname="run")
        data = json.dumps(record, indent=1).encode()
        info = tarfile.TarInfo(RECORD)
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    tmp.replace(archive)
    return archive


def load_on_cpu(archive: Path, work: Path) -> dict[str, Any]:
    """Resume the device's checkpoint on CPU (fp32, gloo, 2 workers on Ray) for one step: the CPU's loss
    of that step against the device's, and the tolerance."""
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(work, filter="data")
    record = json.loads((work / RECORD).read_text())
    step = int(record["next_step"])
    on_cpu = (*DRY.scaling(2), f"training.precision={DRY.precision}", f"training.max_steps={step}")
    result = resume(work / "run", *on_cpu)
    loss = _loss_of(result, step)
    device_loss = float(record["loss"])
    return {
        "step": step,
        "loss": loss,
        "device_loss": device_loss,
        "difference": abs(loss - device_loss),
        "tolerance": tolerance(device_loss, {DRY.precision, str(record["precision"])}),
        "record": record,
        "changes": result["changes"],
        "wall_s": result["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a checkpoint made on CPU for the GPU check, or loaded back")
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("prepare", help="train on CPU and leave the run folder and expected.json in DEST")
    made.add_argument("--dest", type=Path, default=KIT)
    load = sub.add_parser("load", help="resume a gpu-checkpoint.tar.gz on CPU at world size 2")
    load.add_argument("--archive", type=Path, default=ROOT / "benchmarks" / "results" / ARCHIVE)
    load.add_argument("--work", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported: this side is the CPU
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback
    if args.command == "prepare":
        print(json.dumps(prepare(args.dest.resolve()), indent=1))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="elastictrain-gpu-checkpoint-"))
    found = load_on_cpu(args.archive, work)
    print(json.dumps(found, indent=1))
    return 0 if found["difference"] <= found["tolerance"] else 1


if __name__ == "__main__":
    import sys

    code = main()
    sys.stdout.flush()
    os._exit(code)  # DeepSpeed's and Ray's threads can hang an interpreter's teardown
