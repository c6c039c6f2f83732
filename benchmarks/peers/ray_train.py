"""The Ray Train peer: `TorchTrainer` running the peers' DeepSpeed step (train_step.train) in its workers.

A subprocess of the harness, with its own local Ray cluster (or a `ray.cluster_utils.Cluster` of
one-CPU nodes when `spec["cluster_nodes"]` is set, so a node can be removed as a failed one would be).
Checkpoints are DeepSpeed's `save_checkpoint`, reported with `ray.train.report`; restarts are Ray
Train's own (`FailureConfig(max_failures=...)`), resuming from `ray.train.get_checkpoint()`.

    python -m benchmarks.peers.ray_train --spec SPEC.json
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on loopback


def train_fn(config: dict[str, Any]) -> None:
    import ray
    import ray.train
    from ray.train import Checkpoint

    from benchmarks.peers.train_step import train

    spec = dict(config["spec"])
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    if spec.get("nodes_dir"):
        Path(spec["nodes_dir"], f"rank{rank}").write_text(ray.get_runtime_context().get_node_id())
        Path(spec["nodes_dir"], f"rank{rank}.pid").write_text(str(os.getpid()))  # the goodput schedule's
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        spec["ray_checkpoint_dir"] = checkpoint.path  # local storage: the merged folder of every rank

    def report(step: int, save_dir: str) -> None:
        ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(save_dir))

    train(spec, rank, world_size, report=report)


def _remove_node_at_step(spec: dict[str, Any], cluster: Any) -> None:
    """Remove the node of rank `kill_rank` once `kill_at_step` steps are done (a node failure)."""
    steps_file, target = Path(spec["steps_file"]), int(spec["kill_at_step"])
    while True:
        lines = steps_file.read_text().splitlines() if steps_file.exists() else []
        if any(json.loads(line).get("step", -1) >= target for line in lines):
            break
        time.sleep(0.05)
    node_id = Path(spec["nodes_dir"], f"rank{spec['kill_rank']}").read_text().strip()
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    Path(spec["kill_marker"]).write_text(
        json.dumps({"time": time.time(), "step": target, "node_id": node_id})
    )
    cluster.remove_node(node)


def _apply_schedule(spec: dict[str, Any], cluster: Any) -> None:
    """Goodput: `spec["schedule"]`'s failures at their times after the first completed step, as
    elastictrain's goodput run applies them: the last rank's process killed, rank 0's node removed, a
    node added back (each only where it applies). Each one done is a line in `spec["failures_file"]`."""
    import signal

    steps_file, nodes, done = Path(spec["steps_file"]), Path(spec["nodes_dir"]), Path(spec["failures_file"])
    first = None
    while first is None:
        lines = steps_file.read_text().splitlines() if steps_file.exists() else []
        first = next((json.loads(ln)["time"] for ln in lines if '"loss"' in ln), None)
        time.sleep(0.2)
    for at, kind in spec["schedule"]:
        while time.time() < first + at:
            time.sleep(0.2)
        acted = False
        if kind == "worker_killed":
            pids = sorted(nodes.glob("rank*.pid"), key=lambda p: int(p.stem.removeprefix("rank")))
            pid = int(pids[-1].read_text()) if len(pids) > 1 else 0
            cmdline = Path(f"/proc/{pid}/cmdline")
            # Only a live Ray worker: the file may name a process of an attempt that is gone.
            if pid and cmdline.exists() and b"ray::" in cmdline.read_bytes():
                os.kill(pid, signal.SIGKILL)
                acted = True
        elif kind == "node_removed" and len(cluster.worker_nodes) > 1 and (nodes / "rank0").exists():
            node_id = (nodes / "rank0").read_text().strip()
            node = next((n for n in cluster.worker_nodes if n.node_id == node_id), None)
            if node is not None:
                cluster.remove_node(node)
                acted = True
        elif kind == "node_added" and len(cluster.worker_nodes) < int(spec["cluster_nodes"]):
            cluster.add_node(num_cpus=1)
            acted = True
        if acted:
            with open(done, "a", encoding="utf-8") as f:
                f.write(json.dumps({"time": time.time(), "kind": kind}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    env = {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    cluster = None
    if spec.get("cluster_nodes"):
        from ray.cluster_utils import Cluster

        # No exit hooks: they register a SIGTERM handler, which Python allows only in the main thread, and the
        # goodput schedule adds nodes from another one (main() shuts the cluster down; the harness kills
        # this process group at its time limit).
        cluster = Cluster(
            initialize_head=True,
            shutdown_at_exit=False,
            head_node_args={"num_cpus": 0, "include_dashboard": False},
        )
        for _ in range(int(spec["cluster_nodes"])):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env})
        Path(spec["nodes_dir"]).mkdir(parents=True, exist_ok=True)
        chaos = _apply_schedule if spec.get("schedule") else _remove_node_at_step
        if spec.get("schedule") or spec.get("kill_at_step") is not None:
            threading.Thread(target=chaos, args=(spec, cluster), daemon=True).start()
    else:
        cpus = int(spec["max_workers"])
        ray.init(
            address="local",  # a cluster of its own, never another one running on this machine
            num_cpus=cpus,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": env},
        )
    workers = spec["max_workers"] if spec["min_workers"] == spec["max_workers"] else None
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"spec": spec},
        scaling_config=ScalingConfig(
            num_workers=workers or (spec["min_workers"], spec["max_workers"]),
            use_gpu=False,
            resources_per_worker={"CPU": 1},
        ),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name="bench",
            storage_path=spec["storage_path"],
            failure_config=FailureConfig(max_failures=int(spec.get("max_failures", 0))),
        ),
    )
    t0 = time.time()
    outcome: dict[str, Any] = {"fit_s": None, "error": None}
    try:
        trainer.fit()
    except Exception as e:  # noqa: BLE001 - what the peer did is the result
        outcome["error"] = (
            f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:500] if str(e).strip() else ''}"
        )
    outcome["fit_s"] = time.time() - t0
    Path(spec["driver_out"]).write_text(json.dumps(outcome))
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main()
