"""What every benchmark shares: the workload, the launchers of the peers, elastictrain runs, results.

Every system trains the same model on the same data with the same DeepSpeed config (elastictrain's
own `build_deepspeed_config`), one thread per rank. Figures are ratios between systems measured in
the same run; absolute seconds on a shared machine drift.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.validity import judge

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on loopback (driver/launch.py)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "conf" / "tiny-cpu.yaml"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Workload:
    """The model, data and batch every system runs; `smoke` is the smallest that exercises everything."""

    name: str
    overrides: tuple[str, ...]
    warmup_steps: int  # skipped by every system alike
    measured_steps: int
    peer_timeout_s: float  # one peer launch, imports and set-up included

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.measured_steps


_COMMON = (
    "training.global_batch_size=12",  # splits exactly at world sizes 1, 2 and 3
    "training.micro_batch_size=2",
    "training.warmup_steps=2",
    "data.generated_chars=200000",
    "failure.hang_timeout_s=60",
    "failure.collective_timeout_s=60",
    "failure.wait_for_capacity_s=30",
)

SMOKE = Workload("smoke", _COMMON, warmup_steps=1, measured_steps=3, peer_timeout_s=240)
# The peers' workload: a 4-layer Llama, hidden 256, sequence 128 (about 0.5-1 s per step on 2 cores).
FULL = Workload(
    "full",
    (
        *_COMMON,
        "model.hf_config.hidden_size=256",
        "model.hf_config.intermediate_size=512",
        "model.hf_config.num_hidden_layers=4",
        "model.hf_config.max_position_embeddings=128",
        "data.seq_len=128",
    ),
    warmup_steps=3,
    measured_steps=12,
    peer_timeout_s=480,
)


def workload(smoke: bool) -> Workload:
    return SMOKE if smoke else FULL


def config_overrides(w: Workload, run_dir: Path, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", f"training.max_steps={w.steps}", *w.overrides, *extra]


# ---------------------------------------------------------------- environment and results
def machine() -> dict[str, Any]:
    mem = None
    with contextlib.suppress(OSError, ValueError):
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        mem = int(line.split()[1]) * 1024
    cpu = ""
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": list(os.getloadavg()),
    }


def versions() -> dict[str, str]:
    import deepspeed
    import ray
    import torch
    import transformers

    import elastictrain

    return {
        "elastictrain": getattr(elastictrain, "__version__", "0.1.0"),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "ray": ray.__version__,
        "transformers": transformers.__version__,
    }


def median(values: list[float]) -> float:
    clean = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(clean) if clean else float("nan")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None
    return a / b


@dataclass
class Target:
    """One row of the table: a measured figure against its target."""

    name: str
    value: float | None  # the figure (a ratio, or seconds/bytes where stated in `unit`)
    target: float
    direction: str  # ">=", "<=", ">" or "<"
    unit: str = "x"
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        verdict = judge(self.name, self.value, self.target, self.direction)
        return {
            "name": self.name,
            "value": self.value,
            "target": self.target,
            "direction": self.direction,
            "unit": self.unit,
            "met": verdict.met,
            "missed_by": verdict.missed_by,
            "invalid": verdict.invalid,
            "note": self.note,
        }


@dataclass
class Result:
    benchmark: str
    smoke: bool
    reps: int
    metrics: dict[str, Any] = field(default_factory=dict)  # the medians the table shows
    targets: list[Target] = field(default_factory=list)
    runs: list[Any] = field(default_factory=list)  # every repetition's raw numbers
    notes: list[str] = field(default_factory=list)
    workload: dict[str, Any] = field(default_factory=dict)

    def write(self, results_dir: Path) -> Path:
        results_dir.mkdir(parents=True, exist_ok=True)
        out = {
            "benchmark": self.benchmark,
            "time": datetime.now().isoformat(timespec="seconds"),
            "smoke": self.smoke,
            "repetitions": self.reps,
            "machine": machine(),
            "versions": versions(),
            "workload": self.workload,
            "metrics": self.metrics,
            "targets": [t.as_dict() for t in self.targets],
            "notes": self.notes,
            "runs": self.runs,
        }
        path = results_dir / f"{self.benchmark}.json"
        path.write_text(json.dumps(out, indent=1, default=_jsonable))
        return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def workload_info(w: Workload) -> dict[str, Any]:
    from elastictrain.config import load_config

    cfg = load_config(CONFIG, config_overrides(w, Path("/tmp/unused")))
    hf = dict(cfg.model.hf_config)
    return {
        "name": w.name,
        "hf_config": hf,
        "seq_len": cfg.data.seq_len,
        "global_batch_size": cfg.training.global_batch_size,
        "micro_batch_size": cfg.training.micro_batch_size,
        "zero_stage": cfg.deepspeed.zero_stage,
        "precision": cfg.training.precision,
        "warmup_steps_skipped": w.warmup_steps,
        "measured_steps": w.measured_steps,
        "threads_per_rank": 1,
    }


# ---------------------------------------------------------------- peers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peer_env() -> dict[str, str]:
    from elastictrain.compat.deepspeed.ops import prefer_environment_tools

    # The environment's ninja first on PATH and the op cache elastictrain built, as its own processes
    # have them (compat/deepspeed/ops.py).
    prefer_environment_tools()
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",  # as elastictrain's one-CPU actors and Ray Train's workers get
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass
class PeerRun:
    system: str
    returncode: int | None  # None: killed at the time limit
    wall_s: float
    steps: list[dict[str, Any]]  # rank 0's lines: steps and events, in order, across restarts
    out: dict[str, Any] | None
    driver_out: dict[str, Any] | None
    kill: dict[str, Any] | None
    log_tail: str

    def step_records(self) -> list[dict[str, Any]]:
        return [s for s in self.steps if "event" not in s]


TRAIN_SCRIPT = ROOT / "benchmarks" / "peers" / "train_step.py"


def peer_command(system: str, world_size: int, spec_path: Path, *, port: int, **kw: Any) -> list[str]:
    if system == "deepspeed":
        # On CPU the launcher counts "devices" from LOCAL_SIZE (see peer_env_for); --num_gpus picks N of them.
        return [
            str(BIN / "deepspeed"),
            "--num_nodes", "1", "--num_gpus", str(world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(TRAIN_SCRIPT), "--spec", str(spec_path),
        ]  # fmt: skip
    if system == "torchrun":
        nnodes = kw.get("nnodes", "1")
        return [
            str(BIN / "torchrun"),
            f"--nnodes={nnodes}", f"--nproc-per-node={kw.get('nproc', world_size)}",
            f"--max-restarts={kw.get('max_restarts', 0)}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench{port}",
            str(TRAIN_SCRIPT), "--spec", str(spec_path),
        ]  # fmt: skip
    if system == "ray_train":
        return [sys.executable, "-m", "benchmarks.peers.ray_train", "--spec", str(spec_path)]
    raise ValueError(f"system: got {system!r}; expected deepspeed, torchrun or ray_train")


def run_peer(
    system: str,
    world_size: int,
    w: Workload,
    tmp: Path,
    *,
    spec_extra: dict[str, Any] | None = None,
    overrides: tuple[str, ...] = (),
    timeout_s: float | None = None,
    after_kill_timeout_s: float | None = None,
    launch: dict[str, Any] | None = None,
    extra_procs: int = 0,
) -> PeerRun:
    """Launch one peer run and wait for it (killing its whole process group at the time limit).

    `after_kill_timeout_s` bounds the wait once the injected failure happened: a restart that hangs
    (torchrun's did, for 15 minutes, on this machine) is stopped and reported as such. `extra_procs`
    starts more torchrun agents (the nodes of an elastic torchrun job, one rank each).
    """
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {
        "config_path": str(CONFIG),
        "overrides": config_overrides(w, tmp / "run", *overrides),
        "steps": w.steps,
        "steps_file": str(tmp / "steps.jsonl"),
        "out": str(tmp / "out.json"),
        "driver_out": str(tmp / "driver.json"),
        "storage_path": str(tmp / "ray_storage"),
        "ray_local_dir": str(tmp / "ray_local"),
        "min_workers": world_size,
        "max_workers": world_size,
        **(spec_extra or {}),
    }
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    env = peer_env()
    if system == "deepspeed":
        env["LOCAL_SIZE"] = str(world_size)
    cmd = peer_command(system, world_size, spec_path, port=port, **(launch or {}))
    log_path = tmp / "log.txt"
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.time()
    with open(log_path, "ab") as log:
        for _ in range(1 + extra_procs):
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        deadline = t0 + (timeout_s or w.peer_timeout_s)
        marker = Path(spec["kill_marker"]) if spec.get("kill_marker") else None
        kill_agent = (launch or {}).get("kill_agent_at_step")
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            if marker is not None and marker.exists() and after_kill_timeout_s is not None:
                deadline = min(deadline, json.loads(marker.read_text())["time"] + after_kill_timeout_s)
            if (
                kill_agent is not None
                and marker is not None
                and not marker.exists()
                and any(r.get("step", -1) >= kill_agent for r in _read_lines(Path(spec["steps_file"])))
            ):
                # A node lost: its torchrun agent and its rank vanish together.
                marker.write_text(json.dumps({"time": time.time(), "step": kill_agent}))
                _kill_group(procs[-1])
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
    _remove_shm(port)
    rc = (
        procs[0].returncode
        if all(p.returncode is not None for p in procs) and time.time() < deadline
        else None
    )
    return PeerRun(
        system=system,
        returncode=rc,
        wall_s=time.time() - t0,
        steps=_read_lines(Path(spec["steps_file"])),
        out=_read_json(Path(spec["out"])),
        driver_out=_read_json(Path(spec["driver_out"])),
        kill=_read_json(Path(spec["kill_marker"])) if spec.get("kill_marker") else None,
        log_tail=log_path.read_text(errors="replace")[-3000:],
    )


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


def _remove_shm(port: int) -> None:
    # DeepSpeed's CPU all-reduce leaves ~69 MB per rank in /dev/shm, named after the rendezvous.
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def peer_check(run: PeerRun, what: str) -> None:
    if run.returncode != 0 or run.out is None:
        raise RuntimeError(
            f"{run.system} {what}: exit code {run.returncode} after {run.wall_s:.0f}s; "
            f"log tail:\n{run.log_tail}"
        )


def steady_samples_per_s(step_times: list[float], global_batch: int, warmup: int) -> dict[str, float]:
    measured = step_times[warmup:]
    med = median(measured)
    return {
        "step_s_median": med,
        "samples_per_s": global_batch / med if med else float("nan"),
        "steps": len(measured),
    }


# ---------------------------------------------------------------- elastictrain
def record_steps(records: list[dict[str, Any]]) -> Callable[[Any], None]:
    """A controller hook keeping each reported step's time (as the controller measures it) and wall clock."""

    def after_step(controller: Any, _index: int, results: list[dict[str, Any]]) -> None:
        records.append(
            {
                "step": controller.step,
                "time": time.time(),
                "step_s": controller.pipeline.last_step_s,
                "rank_step_s": max(r["step_time_s"] for r in results),
                "world_size": controller.world_size,
            }
        )

    def hook(controller: Any) -> None:
        controller.callbacks.after_step.append(after_step)

    return hook


def worker_peak_rss(controller: Any) -> list[dict[str, Any]]:
    """Peak resident memory (VmHWM) of every active worker actor's process, read from /proc on this node."""
    out = []
    for w in controller.active:
        pid = w.info["pid"]
        status = Path(f"/proc/{pid}/status").read_text()
        hwm = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM"))
        out.append({"worker": w.worker_id, "pid": pid, "peak_rss_bytes": hwm * 1024})
    return out


def run_elastictrain(cfg: Any, hook: Any = None, worker_class: type | None = None) -> Any:
    """Train `cfg` through elastictrain's API on the Ray cluster already connected; returns the RunDir.
    `worker_class`: FaultyTrainWorker where the benchmark injects faults."""
    from elastictrain.control.progress import Reporter
    from elastictrain.driver.launch import prepare_run_dir, run_training

    run_dir, _ = prepare_run_dir(cfg, fresh=False)
    summary = run_training(
        cfg,
        run_dir,
        tracking=False,
        reporter=Reporter(cfg.training.max_steps, stream=io.StringIO(), live=False),
        controller_hook=hook,
        worker_class=worker_class,
    )
    if summary.status.value != "FINISHED":
        # What led there, kept in the message: benchmarks remove a failed run's folder (its checkpoints).
        story = [
            f"{e.get('time', '')[11:19]} {e['event']}: {str(e.get('message') or e.get('kind') or '')[:200]}"
            for e in run_dir.read_events()
            if e["event"] in ("attempt_started", "failure", "memory_ceiling", "decision", "checkpoint")
        ]
        raise RuntimeError(
            f"elastictrain run {run_dir.path} ended {summary.status.value}: {summary.message}\n"
            + "\n".join(story[-12:])
        )
    return run_dir


def event_time(e: dict[str, Any]) -> float:
    return datetime.fromisoformat(e["time"]).timestamp()


def load(overrides: list[str]) -> Any:
    from elastictrain.config import load_config

    return load_config(CONFIG, overrides)
