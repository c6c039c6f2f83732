"""The peers' training script: elastictrain's model, data, batch split and DeepSpeed config, no elasticity.

One rank of a DeepSpeed ZeRO-3 job, started by the `deepspeed` launcher, by `torchrun`, or called as
`train(spec)` from a Ray Train worker. Every rank runs the step elastictrain's worker runs (the same
global data order, LR schedule and per-micro-batch seeding), so the systems differ only in what runs
around the step. Rank 0 appends one JSON line per completed step to `spec["steps_file"]` (wall-clock
time included), so recovery can be read across restarts of the processes.

Besides steps, a run can (all timed, results in `spec["out"]`, written by rank 0):
  - time one DeepSpeed `save_checkpoint` into `deepspeed_save_dir` after the steps;
  - kill rank `kill_rank` at step `kill_at_step` once (a marker file remembers it across restarts);
  - save DeepSpeed checkpoints every `ckpt_every` steps and resume from the newest one;
  - after the steps, time `save_reps` DeepSpeed `save_checkpoint` calls against elastictrain's fragment
    save of the same state (into `save_dir`, which a resharding benchmark then reads);
  - load a universal checkpoint (`load_universal`) and an elastictrain fragment checkpoint
    (`load_fragments`) into this world size, timed, with the loss each gives on the same batch.

    deepspeed --num_nodes 1 --num_gpus N benchmarks/peers/train_step.py --spec SPEC.json
    torchrun --standalone --nproc-per-node N benchmarks/peers/train_step.py --spec SPEC.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported


def _config(spec: dict[str, Any]) -> Any:
    from elastictrain.config import load_config

    return load_config(spec["config_path"], list(spec["overrides"]))


def _append_line(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _scalar(value: float) -> Any:
    """A one-element tensor on the device the process group's backend reduces (NCCL: the GPU)."""
    import torch
    import torch.distributed as dist

    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    return torch.tensor([value], dtype=torch.float64, device=device)


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = _scalar(value)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def build_engine(cfg: Any, world_size: int, *, load_universal: bool = False) -> tuple[Any, Any, Any]:
    """(engine, batch plan, dataset) built as elastictrain's worker builds them (TrainWorker.setup)."""
    import deepspeed
    import torch

    from elastictrain.config.deepspeed_config import build_deepspeed_config
    from elastictrain.core.batch import plan_batch
    from elastictrain.data.sources import dataset_from_config
    from elastictrain.model.build import build_model, preload_model_code

    plan = plan_batch(cfg.training.global_batch_size, cfg.training.micro_batch_size, world_size)
    if plan is None:
        raise ValueError(f"world size {world_size} does not split the global batch exactly")
    ds_config = build_deepspeed_config(cfg, plan.micro_batch_size, plan.grad_accum_steps, world_size)
    if load_universal:
        ds_config["checkpoint"] = {"load_universal": True}
    dataset = dataset_from_config(cfg)
    torch.manual_seed(cfg.training.seed)
    preload_model_code(cfg)
    model = build_model(cfg, ds_config, zero3=cfg.deepspeed.zero_stage == 3)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
    )
    if cfg.model.compile:
        engine.compile()  # as elastictrain's worker does (model/build.new_engine)
    return engine, plan, dataset


def _batch(cfg: Any, dataset: Any, engine: Any, positions: range) -> Any:
    from elastictrain.core.data_order import sample_at
    from elastictrain.data.sources import collate_items, to_device
    from elastictrain.user_code import user_callable

    items = [dataset[sample_at(p, len(dataset), cfg.training.seed)] for p in positions]
    return to_device(collate_items(items, user_callable(cfg, "data.collate")), engine.device)


def train_step(engine: Any, plan: Any, dataset: Any, cfg: Any, step: int, rank: int) -> float:
    """One optimizer step: elastictrain's `TrainWorker._train_step` without its bookkeeping."""
    import torch

    from elastictrain.core.data_order import derive_seed, micro_batch_positions
    from elastictrain.core.schedule import step_learning_rate
    from elastictrain.model.build import loss_function

    t = cfg.training
    lr = step_learning_rate(step, t)
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    loss_fn = loss_function(cfg)
    losses = []
    for micro in range(plan.grad_accum_steps):
        positions = micro_batch_positions(step, plan, rank, micro)
        batch = _batch(cfg, dataset, engine, positions)
        torch.manual_seed(derive_seed(t.seed, positions.start))
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float().item()))
    return sum(losses) / len(losses)


def _eval_loss(engine: Any, plan: Any, dataset: Any, cfg: Any, rank: int) -> float:
    """The loss on one fixed batch (the first samples of the data order) on every rank: equal states,
    at any world size, give equal values."""
    import torch

    from elastictrain.model.build import loss_function

    batch = _batch(cfg, dataset, engine, range(cfg.training.micro_batch_size))
    with torch.no_grad():
        loss = float(loss_function(cfg)(engine, batch).item())
    return _mean_over_ranks(loss)


def _mean_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = _scalar(value)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _save_fragments(
    engine: Any, out_dir: Path, rank: int, world_size: int, max_host_memory_mb: float | None
) -> dict[str, Any]:
    """elastictrain's checkpoint write, through the worker's own code (checkpoint/rank_save.py): the
    snapshot the background path pauses for, its durable write, and the streamed synchronous path.
    The snapshot is bounded as a worker bounds it (all ranks on this node): one that does not fit is
    streamed instead, as the worker would (a 1B rank's 5.4 GiB copy ran this machine out of memory)."""
    from elastictrain.checkpoint.rank_save import prepare_rank_write
    from elastictrain.host.memory import snapshot_budget_bytes

    out_dir.mkdir(parents=True, exist_ok=True)
    budget = snapshot_budget_bytes(max_host_memory_mb, world_size)
    t0 = time.perf_counter()
    write, info = prepare_rank_write(
        engine, out_dir, rank, world_size, snapshot=True, max_snapshot_bytes=budget
    )
    snapshot_s = time.perf_counter() - t0
    if info["mode"] == "snapshot":  # a streamed write is done already: the snapshot did not fit
        write.run()
    save_s = time.perf_counter() - t0
    streamed = out_dir.parent / f"{out_dir.name}-streamed"
    streamed.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stream, _ = prepare_rank_write(engine, streamed, rank, world_size, snapshot=False)
    stream_s = time.perf_counter() - t0
    for w in (write, stream):
        if w.error:
            raise RuntimeError(w.error)
    return {
        "snapshot_s": snapshot_s,
        "save_s": save_s,
        "stream_s": stream_s,
        "bytes": write.file["bytes"] if write.file else 0,
        "scalars": info["engine_state"],
        "mode": info["mode"],
    }


def _remove_timed_copies(save_dir: Path, rep: int, *, last: bool) -> None:
    """The streamed copy only timed a path; earlier repetitions' saves are not read again."""
    import shutil

    shutil.rmtree(save_dir / f"fragments{rep}-streamed", ignore_errors=True)
    if not last:
        shutil.rmtree(save_dir / "deepspeed" / f"bench{rep}", ignore_errors=True)
        shutil.rmtree(save_dir / f"fragments{rep}", ignore_errors=True)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def train(spec: dict[str, Any], rank: int, world_size: int, *, report: Any = None) -> dict[str, Any] | None:
    """Run one rank. `report(step, save_dir)` is Ray Train's hook after a checkpoint is saved."""
    import deepspeed
    import torch
    import torch.distributed as dist

    t_start = time.time()
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    backend = spec.get("backend", "gloo")  # "nccl" on GPUs (the environment then sets DS_ACCELERATOR=cuda)
    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(seconds=120)
        )
    else:
        deepspeed.init_distributed(dist_backend=backend)  # wraps the group the launcher (Ray Train) made
    cfg = _config(spec)
    engine, plan, dataset = build_engine(cfg, world_size, load_universal=bool(spec.get("load_universal")))
    setup_done = time.time()
    out: dict[str, Any] = {
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "parameters": sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()),
        "setup_s": setup_done - t_start,
    }

    # Resume from the newest DeepSpeed checkpoint, if the harness asked for checkpoints and one exists.
    step = 0
    resume_dir = spec.get("resume_dir")
    if report is not None and spec.get("ray_checkpoint_dir"):
        resume_dir = spec["ray_checkpoint_dir"]
    if resume_dir and (Path(resume_dir) / "latest").exists():
        t0 = time.perf_counter()
        try:
            _, client = engine.load_checkpoint(resume_dir)
        except Exception as e:  # noqa: BLE001 - a ZeRO-3 checkpoint of another world size: recorded
            if rank == 0:
                _append_line(
                    spec["steps_file"], {"event": "resume_failed", "error": f"{type(e).__name__}: {e}"}
                )
            raise
        step = int(client["step"])
        if rank == 0:
            _append_line(
                spec["steps_file"],
                {"event": "resumed", "step": step, "time": time.time(), "load_s": time.perf_counter() - t0},
            )

    if rank == 0:
        _append_line(spec["steps_file"], {"event": "attempt_start", "step": step, "time": time.time()})
    kill_at, kill_rank = spec.get("kill_at_step"), spec.get("kill_rank", world_size - 1)
    marker = Path(spec["kill_marker"]) if spec.get("kill_marker") else None
    ckpt_every = int(spec.get("ckpt_every") or 0)
    while step < spec["steps"]:
        if kill_at is not None and step == kill_at and rank == kill_rank and marker and not marker.exists():
            marker.write_text(json.dumps({"time": time.time(), "step": step, "world_size": world_size}))
            os._exit(17)  # a worker's death, mid-run
        t0 = time.perf_counter()
        loss = train_step(engine, plan, dataset, cfg, step, rank)
        step += 1
        if rank == 0:
            rec = {"step": step, "time": time.time(), "step_s": time.perf_counter() - t0, "loss": loss}
            _append_line(spec["steps_file"], {**rec, "world_size": world_size})
        if ckpt_every and step % ckpt_every == 0 and step < spec["steps"]:
            t0 = time.perf_counter()
            save_dir = (
                spec["resume_dir"] if report is None else f"{spec['ray_local_dir']}/step{step}/rank{rank}"
            )
            engine.save_checkpoint(save_dir, tag=f"step{step}", client_state={"step": step})
            seconds = time.perf_counter() - t0
            if report is not None:
                report(step, save_dir)
            if rank == 0:
                _append_line(
                    spec["steps_file"],
                    {"event": "checkpoint", "step": step, "s": seconds, "total_s": time.perf_counter() - t0},
                )

    # DeepSpeed's own save once, timed (the GPU check sets it beside elastictrain's checkpoint pause).
    if spec.get("deepspeed_save_dir"):
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(spec["deepspeed_save_dir"], tag="timed", client_state={"step": step})
        out["deepspeed_save_checkpoint_s"] = _max_over_ranks(time.perf_counter() - t0)
        if rank == 0:
            out["deepspeed_checkpoint_bytes"] = _dir_bytes(Path(spec["deepspeed_save_dir"]) / "timed")

    # Checkpoint stall: DeepSpeed's synchronous save against elastictrain's save, same state, same ranks.
    if spec.get("save_reps"):
        save_dir = Path(spec["save_dir"])
        ds_times, frag_times, snap_times, stream_times = [], [], [], []
        frag: dict[str, Any] = {}
        for i in range(int(spec["save_reps"])):
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(str(save_dir / "deepspeed"), tag=f"bench{i}", client_state={"step": step})
            ds_times.append(_max_over_ranks(time.perf_counter() - t0))
            dist.barrier()
            frag = _save_fragments(
                engine, save_dir / f"fragments{i}", rank, world_size, cfg.checkpoint.max_host_memory_mb
            )
            frag_times.append(_max_over_ranks(frag["save_s"]))
            snap_times.append(_max_over_ranks(frag["snapshot_s"]))
            stream_times.append(_max_over_ranks(frag["stream_s"]))
            dist.barrier()
            if rank == 0:  # only the last repetition's saves are read later: at 1B each copy is 11 GB
                _remove_timed_copies(save_dir, i, last=i == int(spec["save_reps"]) - 1)
        dist.barrier()
        last = int(spec["save_reps"]) - 1
        if rank == 0:
            _write_fragment_manifest(save_dir / f"fragments{last}", world_size, step, frag["scalars"], cfg)
        out["save"] = {
            "deepspeed_save_checkpoint_s": ds_times,
            "elastictrain_save_s": frag_times,
            "elastictrain_snapshot_s": snap_times,
            "elastictrain_stream_s": stream_times,
            "fragment_bytes": frag["bytes"] * world_size,
            "elastictrain_mode": frag["mode"],  # "snapshot", or "streamed" where a snapshot does not fit
            "deepspeed_tag": f"bench{last}",
            "deepspeed_bytes": _dir_bytes(save_dir / "deepspeed" / f"bench{last}") if rank == 0 else None,
            "fragments_dir": str(save_dir / f"fragments{last}"),
            "eval_loss": _eval_loss(engine, plan, dataset, cfg, rank),
        }

    # Resharding: load a checkpoint saved at another world size into this one (both routes), timed.
    if spec.get("load_universal") or spec.get("load_fragments"):
        loads: dict[str, Any] = {}
        if spec.get("load_universal"):
            dist.barrier()
            t0 = time.perf_counter()
            engine.load_checkpoint(spec["load_universal"], tag=spec["load_universal_tag"])
            loads["universal_load_s"] = _max_over_ranks(time.perf_counter() - t0)
            loads["universal_eval_loss"] = _eval_loss(engine, plan, dataset, cfg, rank)
        if spec.get("load_fragments"):
            from elastictrain.checkpoint.zero_state import FragmentReader, load_local_state

            dist.barrier()
            t0 = time.perf_counter()
            ck = Path(spec["load_fragments"])
            manifest = json.loads((ck / "manifest.json").read_text())
            reader = FragmentReader([ck / f["name"] for f in manifest["files"]])
            load_local_state(engine, reader, manifest.get("engine_state", {}))
            loads["fragments_load_s"] = _max_over_ranks(time.perf_counter() - t0)
            loads["fragments_eval_loss"] = _eval_loss(engine, plan, dataset, cfg, rank)
        out["load"] = loads

    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks: list[Any] = [None] * world_size
    mine = {"rank": rank, "peak_rss_bytes": peak_kb * 1024, "start_rss_bytes": rss_before_kb * 1024}
    if torch.cuda.is_available() and backend == "nccl":
        mine["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    dist.all_gather_object(peaks, mine)
    out["memory"] = peaks
    out["steps_done"] = step
    if rank == 0 and spec.get("out"):
        Path(spec["out"]).write_text(json.dumps(out, indent=1))
    dist.barrier()
    return out if rank == 0 else None


def _write_fragment_manifest(
    path: Path, world_size: int, step: int, scalars: dict[str, Any], cfg: Any
) -> None:
    files = sorted(path.glob("rank-*.safetensors"))
    manifest = {
        "step": step,
        "world_size": world_size,
        "files": [{"name": f.name, "bytes": f.stat().st_size} for f in files],
        "engine_state": scalars,
        "model": {"hf_config": dict(cfg.model.hf_config)},
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train(spec, rank, world_size)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of gloo and DeepSpeed threads, which can hang here


if __name__ == "__main__":
    main()
