"""Recovery from memory: steps lost, recovery time memory vs disk, per-step cost, host memory, transport.

steps lost and recovery time: a 2-worker run (min 1) whose last worker is killed a few steps after
    a checkpoint (the recovery benchmark's schedule), with in-memory snapshots every step
    (`checkpoint.memory_every_steps=1`) and without (0: from the disk checkpoint); from the kill to
    the first step completed after it. Ray Train's steps lost on the same schedule come from the
    recovery benchmark's run when it ran in this invocation (else from its last results file).
per-step cost: step time of a fault-free world-size-2 run with snapshots every step against the
    same run without, measured steps only (the median of the controller's per-step times); and with
    the default schedule (`checkpoint.memory_max_step_share=0.03`: the controller spaces snapshots out
    until they cost at most 3%), with the interval it settled on.
host memory per rank: what each worker holds with snapshots on (its own last two snapshots and the
    last two replicas it keeps for its buddy), from the workers' own count, against the bytes of one
    rank's slice of the state.
transport: one rank's snapshot sent to its buddy by an actor call, its tensors as numpy arrays (what
    elastictrain does: Ray moves them out of band, one copy through the object store) and as torch
    tensors (pickled by torch). `ray.put` with the buddy as owner is not an option: Ray 2.56 removed
    the `_owner` argument, and an object owned by the sender is lost with it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks import baselines, recovery
from benchmarks.common import (
    RESULTS,
    Result,
    Target,
    Workload,
    config_overrides,
    load,
    median,
    ratio,
    record_steps,
    run_elastictrain,
    workload_info,
)

# Every step whatever it costs (the steps-lost figures are for this), none, and the default schedule.
ON = ("checkpoint.memory_every_steps=1", "checkpoint.memory_max_step_share=0")
OFF = ("checkpoint.memory_every_steps=0",)
AUTO: tuple[str, ...] = ()
# Every other step, in one run: the steps a copy runs beside against the steps without, side by side.
INTERLEAVED = ("checkpoint.memory_every_steps=2", "checkpoint.memory_max_step_share=0")
INTERLEAVED_STEPS = 80  # 40 steps of each kind after the warm-up: a difference of 1-2% stands out


def _fault_free(
    w: Workload, tmp: Path, memory: tuple[str, ...], steps_n: int | None = None
) -> dict[str, Any]:
    """A world-size-2 run: its measured steps' times and, with snapshots on, what the workers hold."""
    baselines.ensure_local_ray()
    n = steps_n or w.steps
    cfg = load(
        config_overrides(
            w,
            tmp,
            "scaling.min_workers=2",
            "scaling.max_workers=2",
            f"checkpoint.every_steps={n}",
            *memory,
        )
        + [f"training.max_steps={n}"]
    )
    steps: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    interval: list[int] = []

    def hook(controller: Any) -> None:
        record_steps(steps)(controller)

        def after_step(_c: Any, _index: int, results: list[dict[str, Any]]) -> None:
            held.extend(r["memory"] for r in results if r.get("memory"))
            interval[:] = [_c.pipeline.snapshots.interval]

        controller.callbacks.after_step.append(after_step)

    run_elastictrain(cfg, hook)
    measured = [s["step_s"] for s in steps if s["step"] > w.warmup_steps]
    last = held[-2:] if held else []
    return {
        "step_s": median(measured),
        "steps_s": measured,
        "numbered_steps_s": [(s["step"], s["step_s"]) for s in steps if s["step"] > w.warmup_steps],
        "held_bytes_per_rank": max((h["held_bytes"] for h in last), default=None),
        "copy_s": median([h["copy_s"] for h in held if h["copy_s"]]),
        "replicate_s": median([h["replicate_s"] for h in held if h["replicate_s"]]),
        "interval": interval[-1] if interval else None,  # steps between snapshots at the end
        "off": next((h["off"] for h in held if h.get("off")), ""),  # why snapshots were off, if they were
    }


def interleaved_cost(w: Workload, tmp: Path, steps_n: int = INTERLEAVED_STEPS) -> dict[str, Any]:
    """What a snapshot costs the step it runs beside, from one run with a snapshot every other step.

    A snapshot of the state after step k (k steps done, k even) is copied while step k+1 runs (whose
    update waits for the copy) and replicated beside it and after: the steps reported with an odd count
    ran beside a copy, the even ones did not. Their medians, taken in the same minutes on the same
    workers, cancel what separate runs cannot: this machine's speed drifts between runs by more than the
    3% measured.
    """
    run = _fault_free(w, tmp, INTERLEAVED, steps_n)
    beside = [t for step, t in run["numbered_steps_s"] if step % 2 == 1]
    without = [t for step, t in run["numbered_steps_s"] if step % 2 == 0]
    return {
        "step_s_beside_a_copy": median(beside),
        "step_s_without": median(without),
        "cost": median(beside) / median(without) - 1.0,
        "steps": len(beside) + len(without),
        "copy_s": run["copy_s"],
        "replicate_s": run["replicate_s"],
        "off": run["off"],
    }


def copy_cpu_cost(w: Workload, tmp: Path, blocks: int) -> dict[str, float]:
    """CPU seconds per step with and without the in-memory copy, in this process (world size 1).

    Alternating blocks of steps of one in-process worker (the product's TrainWorker, as --local runs
    it), with its copy thread joined inside each step's measurement: the copy's CPU is counted with its
    step. CPU time, unlike wall time, does not move with other processes' load on a shared machine.
    """
    import socket
    import statistics

    from elastictrain.config.deepspeed_config import build_deepspeed_config
    from elastictrain.core.batch import plan_batch
    from elastictrain.worker.actor import TrainWorker
    from elastictrain.worker.attempt import AttemptSpec

    cfg = load(config_overrides(w, tmp, "training.max_steps=100000"))
    plan = plan_batch(cfg.training.global_batch_size, cfg.training.micro_batch_size, 1)
    assert plan is not None
    worker = TrainWorker("copy-cost", False)
    cpu: dict[int, list[float]] = {0: [], 1: []}
    step = 0
    for block in range(blocks):
        for every in (1, 0):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ds = build_deepspeed_config(cfg, plan.micro_batch_size, plan.grad_accum_steps, 1)
            worker.setup(
                AttemptSpec(
                    attempt=2 * block + every + 1, rank=0, world_size=1, master_addr="127.0.0.1",
                    master_port=port, backend="gloo", plan=plan, config=cfg, ds_config=ds,
                    checkpoint_dir=None, start_step=step, snapshot_every=every,
                )
            )  # fmt: skip
            for i in range(6):
                c0 = time.process_time()
                worker.train_step(step)
                worker.memory.wait()
                if i >= 1:  # the first step of a block pays for the new engine
                    cpu[every].append(time.process_time() - c0)
                step += 1
            worker.teardown()
    on, off = statistics.median(cpu[1]), statistics.median(cpu[0])
    return {"cpu_s_on": on, "cpu_s_off": off, "cost": on / off - 1, "copy_s": worker.memory.last_copy_s}


def copy_cpu_cost_as_workers_run(w: Workload, tmp: Path, blocks: int) -> dict[str, float]:
    """`copy_cpu_cost` in a process started with the workers' malloc (`scaling.worker_allocator`, by
    default jemalloc keeping freed pages: cluster/allocator.py), as the product's copies run. In the
    benchmark's own process (glibc) each copy's new buffer is fresh pages from the kernel: 20 ms of CPU
    per 50 MB copied, where jemalloc's reused pages take 7 ms."""
    import dataclasses
    import os
    import subprocess
    import sys

    from elastictrain.cluster.allocator import allocator_env

    cfg = load(config_overrides(w, tmp))
    env = {**os.environ, **allocator_env(cfg.scaling.worker_allocator)}
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from benchmarks.common import Workload\n"
        "from benchmarks.memory_recovery import copy_cpu_cost\n"
        "w = json.loads(sys.argv[1])\n"
        "w = Workload(**{**w, 'overrides': tuple(w['overrides'])})\n"
        "print(json.dumps(copy_cpu_cost(w, Path(sys.argv[2]), int(sys.argv[3]))))\n"
    )
    args = [sys.executable, "-c", code, json.dumps(dataclasses.asdict(w)), str(tmp), str(blocks)]
    done = subprocess.run(
        args, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"copy cost process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "allocator": cfg.scaling.worker_allocator}


def _slice_bytes(held_bytes: float | None) -> float | None:
    """One rank's slice of the state: a worker holds two of its own snapshots and two replicas."""
    return held_bytes / 4 if held_bytes else None


def transport(nbytes: int, reps: int = 5) -> dict[str, float]:
    """Seconds to get a snapshot of `nbytes` (eight tensors viewing one buffer, as a rank's copy does)
    from one actor into another's memory: as the product sends a replica (over the buddy's socket,
    worker/snapshots/replica_link.py, kept with `Snapshot.from_frame`), by the actor call it falls back to
    (`Snapshot.to_wire`, kept with `Snapshot.from_wire`), and as pickled torch tensors."""
    import ray

    baselines.ensure_local_ray()

    @ray.remote(num_cpus=0)
    class Buddy:
        def __init__(self) -> None:
            self.kept: list[Any] = []

        def address(self) -> dict[str, Any]:
            from elastictrain.worker.snapshots.format import Snapshot
            from elastictrain.worker.snapshots.replica_link import ReplicaServer

            def keep(header: dict[str, Any], data: Any, _cpu_s: float) -> None:
                self.kept[:] = [Snapshot.from_frame(header, data)]  # a replica, as a worker keeps it

            self.server = ReplicaServer("127.0.0.1", keep)
            return self.server.address

        def hold(self, wire: Any) -> int:
            from elastictrain.worker.snapshots.format import Snapshot

            if isinstance(wire, dict) and "flat" in wire:
                return Snapshot.from_wire(wire).nbytes  # a replica, as a worker keeps it
            kept = {k: t.clone() for k, t in wire.items()}  # unpickled tensors, made ours
            return sum(t.numel() * 4 for t in kept.values())

    @ray.remote(num_cpus=0)
    class Sender:
        def __init__(self, n: int) -> None:
            import torch

            from elastictrain.worker.snapshots.format import Snapshot, SnapshotKey

            flat = torch.ones(n // 4)
            part = flat.numel() // 8
            tensors = {f"p{i}::fp32": flat.narrow(0, i * part, part) for i in range(8)}
            self.snapshot = Snapshot(SnapshotKey(1, 2, 0, 1), tensors, {}, {}, flat=flat)
            self.sender: Any = None

        def connect(self, address: dict[str, Any]) -> None:
            from elastictrain.worker.snapshots.replica_link import ReplicaSender

            self.sender = ReplicaSender(address, timeout_s=30)

        def send(self, buddy: Any, how: str) -> float:
            t0 = time.perf_counter()
            if how == "socket":
                self.sender.send(*self.snapshot.to_frame())
            else:
                wire = self.snapshot.to_wire() if how == "actor_call" else dict(self.snapshot.tensors)
                ray.get(buddy.hold.remote(wire))
            return time.perf_counter() - t0

    buddy, sender = Buddy.remote(), Sender.remote(nbytes)
    hows = ("socket", "actor_call", "torch_pickle")
    try:
        ray.get(sender.connect.remote(ray.get(buddy.address.remote())))
        ray.get([sender.send.remote(buddy, how) for how in hows])  # warm each once
        seconds = {
            how: median([ray.get(sender.send.remote(buddy, how)) for _ in range(reps)]) for how in hows
        }
    finally:
        ray.kill(buddy)
        ray.kill(sender)
    return {f"{how}_s": s for how, s in seconds.items()} | {"bytes": float(nbytes)}


def _ray_train_recovery(runs_this_time: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    if runs_this_time:
        return runs_this_time, "this invocation's recovery benchmark"
    path = RESULTS / "recovery.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return data["metrics"]["worker_killed"]["ray_train"], f"{path.name} of {data['time']}"
    return {}, "not measured"


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        on = _fault_free(w, tmp / f"cost-on-rep{rep}", ON)
        if smoke:  # the harness's own test: no second fault-free run, the recovery benchmark's kill run
            off = auto = {"step_s": None, "interval": None}
            memory = dict(recovery.LAST_ELASTICTRAIN) or recovery.elastictrain_worker_killed(
                w, tmp / "k", *ON
            )
            disk = {"steps_lost": None, "death_to_first_step_s": None}
        else:
            off = _fault_free(w, tmp / f"cost-off-rep{rep}", OFF)
            auto = _fault_free(w, tmp / f"cost-auto-rep{rep}", AUTO)
            memory = recovery.elastictrain_worker_killed(w, tmp / f"killed-memory-rep{rep}", *ON)
            disk = recovery.elastictrain_worker_killed(w, tmp / f"killed-disk-rep{rep}", *OFF)
        sizes = (64 << 20,) if not smoke else (4 << 20,)
        moved = [transport(n) for n in sizes]
        cpu = copy_cpu_cost_as_workers_run(w, tmp / f"copy-cost-rep{rep}", 2 if smoke else 4)
        paired_steps = 2 * w.steps if smoke else INTERLEAVED_STEPS
        paired = interleaved_cost(w, tmp / f"interleaved-rep{rep}", paired_steps)
        runs.append(
            {
                "rep": rep,
                "on": on,
                "off": off,
                "auto": auto,
                "memory": memory,
                "disk": disk,
                "transport": moved,
                "cpu": cpu,
                "interleaved": paired,
            }
        )
        seconds = (memory["death_to_first_step_s"], disk["death_to_first_step_s"])
        print(
            f"  memory_recovery rep {rep}: steps {on['step_s']} vs {off['step_s']}; recovery {seconds}",
            flush=True,
        )
    ray_train, ray_source = _ray_train_recovery(recovery.LAST_RAY_TRAIN)
    step_on = median([r["on"]["step_s"] for r in runs])
    step_off = median([r["off"]["step_s"] for r in runs if r["off"]["step_s"] is not None])
    step_auto = median([r["auto"]["step_s"] for r in runs if r["auto"]["step_s"] is not None])
    held = median([r["on"]["held_bytes_per_rank"] for r in runs if r["on"]["held_bytes_per_rank"]])
    metrics: dict[str, Any] = {
        "steps_lost": {
            "elastictrain_memory": median([r["memory"]["steps_lost"] for r in runs]),
            "elastictrain_disk": median(
                [r["disk"]["steps_lost"] for r in runs if r["disk"]["steps_lost"] is not None]
            ),
            "ray_train": ray_train.get("steps_lost"),
        },
        "death_to_first_step_s": {
            "elastictrain_memory": median([r["memory"]["death_to_first_step_s"] for r in runs]),
            "elastictrain_disk": median(
                [
                    r["disk"]["death_to_first_step_s"]
                    for r in runs
                    if r["disk"]["death_to_first_step_s"] is not None
                ]
            ),
            "ray_train": ray_train.get("death_to_first_step_s"),
        },
        "step_s": {"snapshots_on": step_on, "snapshots_auto": step_auto, "snapshots_off": step_off},
        "step_cost": (step_on / step_off - 1.0) if step_off == step_off else None,  # NaN: not measured
        "step_cost_auto": (step_auto / step_off - 1.0)
        if step_off == step_off and step_auto == step_auto
        else None,
        "step_cost_interleaved": median([r["interleaved"]["cost"] for r in runs]),
        "auto_interval": [r["auto"]["interval"] for r in runs],
        "copy_cpu_cost": median([r["cpu"]["cost"] for r in runs]),
        "step_cpu_s": median([r["cpu"]["cpu_s_off"] for r in runs]),
        "copy_s": median([r["on"]["copy_s"] for r in runs]),
        "replicate_s": median([r["on"]["replicate_s"] for r in runs]),
        "held_bytes_per_rank": held,
        "state_slice_bytes_per_rank": _slice_bytes(held),
        "transport": {
            "bytes": runs[-1]["transport"][-1]["bytes"],
            "socket_s": median([r["transport"][-1]["socket_s"] for r in runs]),
            "actor_call_s": median([r["transport"][-1]["actor_call_s"] for r in runs]),
            "torch_pickle_s": median([r["transport"][-1]["torch_pickle_s"] for r in runs]),
        },
        "recovered_from": [r["memory"].get("recovered_from") for r in runs],
    }
    lost = metrics["steps_lost"]
    seconds = metrics["death_to_first_step_s"]
    targets = [
        Target(
            "memory recovery: steps lost per failure",
            lost["elastictrain_memory"],
            1,
            "<=",
            unit="steps",
            note=f"from disk: {lost['elastictrain_disk']}; Ray Train: {lost['ray_train']} ({ray_source})",
        ),
        Target(
            "memory recovery: kill to first step, memory / disk",
            ratio(seconds["elastictrain_memory"], seconds["elastictrain_disk"]),
            1.0,
            "<=",
        ),
        Target(
            "memory recovery: per-step cost of snapshots and replication (wall)",
            metrics["step_cost"],
            0.03,
            "<=",
            unit="fraction",
            note="2 ranks, step time with snapshots every step / without, minus 1 (moves with load)",
        ),
        Target(
            "memory recovery: per-step cost of a snapshot, beside steps without (wall, one run)",
            metrics["step_cost_interleaved"],
            0.03,
            "<=",
            unit="fraction",
            note=f"2 ranks, a snapshot every other step: median step with a copy beside it / without, "
            f"minus 1, over {runs[-1]['interleaved']['steps']} steps of one run (drift between runs cancels)",
        ),
        Target(
            "memory recovery: per-step cost with the default schedule (wall)",
            metrics["step_cost_auto"],
            0.03,
            "<=",
            unit="fraction",
            note=f"2 ranks, checkpoint.memory_max_step_share=0.03; snapshots every "
            f"{metrics['auto_interval']} step(s) at the end (steps lost on a failure: up to that many)",
        ),
        Target(
            "memory recovery: per-step CPU cost of the copy",
            metrics["copy_cpu_cost"],
            0.03,
            "<=",
            unit="fraction",
            note="one rank in a process with the workers' malloc, CPU seconds per step with / without "
            "the copy, minus 1",
        ),
    ]
    notes = [
        "steps_lost: steps completed before the failure that were trained again after it.",
        "held_bytes_per_rank: the buffers a rank holds after a step: its last two snapshots, two replicas "
        "of its buddy's, and one of each kept for (or being filled by) the next (6x one rank's slice).",
        "transport: a replica sent over the buddy's socket into the array it keeps (what the product "
        "does), against the actor call into the buddy's `replica` concurrency group it falls back to where "
        "that socket cannot be reached, and pickled torch tensors; each one round trip, the replica in the "
        "buddy's own memory, so it outlives the sender's node. Two actors of one node: the network is not "
        "measured.",
        "Goodput under about one failure a minute over 15 minutes: the goodput benchmark.",
    ]
    if smoke:
        notes.append(
            "smoke: smallest workload, 4 MiB transport, no run without snapshots and no disk recovery "
            "(the harness's test): not a measurement."
        )
    info = {**workload_info(w), **recovery.schedule(w), "ray_train_source": ray_source}
    return Result("memory_recovery", smoke, reps, metrics, targets, runs, notes, info)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, key, label in (
        (axes[0], "steps_lost", "steps lost per failure"),
        (axes[1], "death_to_first_step_s", "s from kill to next step"),
    ):
        names = list(m[key])
        ax.bar(names, [m[key][n] or 0 for n in names], color=["C0", "C1", "C2"])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=7)
    steps = m["step_s"]
    axes[2].bar(list(steps), [steps[k] or 0 for k in steps], color=["C0", "C1", "C2"])
    axes[2].set_ylabel("s per step (median)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
