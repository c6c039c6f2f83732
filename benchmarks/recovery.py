"""Recovery: from a worker's death (or a node's loss) to the first completed step after it, and steps lost.

Same workload for every system, checkpoints every `every` steps, the failure right after step `at`:
  worker_killed  elastictrain: 2 workers (min 1); the last worker's actor is killed; the survivor goes
                 on at once at world size 1 (resharded), the replacement joins later by a grow.
                 Ray Train: TorchTrainer, 2 workers, FailureConfig(max_failures=1); rank 1 exits.
                 torchrun: --nproc-per-node=2 --max-restarts=1 (c10d rendezvous); rank 1 exits.
  node_lost      elastictrain: a 3-node `ray.cluster_utils.Cluster` (1 CPU each), 3 workers (min 2); the
                 node of one worker is removed (shrink to 2), one is added back later (grow to 3).
                 Ray Train: same cluster shape, ScalingConfig(num_workers=(2, 3)), the node is removed.
                 torchrun: 3 agents of one rank each, --nnodes=2:3; one agent and its rank are killed.
A peer that has not completed a step `hang_s` seconds after the failure is stopped and reported as
hung; one that ends without training on is reported with its error.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import (
    Result,
    Target,
    Workload,
    config_overrides,
    event_time,
    load,
    median,
    ratio,
    run_elastictrain,
    run_peer,
    workload_info,
)

LAST_RAY_TRAIN: dict[str, Any] = {}  # this invocation's Ray Train figures, for memory_recovery's table
LAST_ELASTICTRAIN: dict[
    str, Any
] = {}  # its elastictrain worker-killed run (snapshots on): the smoke reuses it


def schedule(w: Workload) -> dict[str, int]:
    """(checkpoint every, failure after step): a few steps after a checkpoint, for every system alike."""
    if w.steps <= 6:
        return {"every": 2, "at": 3}
    return {"every": 5, "at": w.steps - 3}


# ---------------------------------------------------------------- elastictrain
def _elastictrain_outcome(run_dir: Any, t_fail: float) -> dict[str, Any]:
    events = run_dir.read_events()
    recovered = [e for e in events if e["event"] == "recovered"]
    first = recovered[0]
    grow = recovered[1:]
    failure = next(e for e in events if e["event"] == "failure")
    restart = next(
        e for e in events if e["event"] == "attempt_started" and event_time(e) >= event_time(failure)
    )
    return {
        "outcome": "recovered",
        "death_to_first_step_s": event_time(first) - t_fail,
        "detection_to_first_step_s": first["recovery_seconds"],
        "steps_lost": first["steps_lost"],
        "grow_restart_s": grow[0]["recovery_seconds"] if grow else None,
        "world_sizes": [h["world_size"] for h in run_dir.read_info().world_size_history],
        "failure_kind": next(e["kind"] for e in events if e["event"] == "failure"),
        "recovered_from": first.get("recovered_from"),
        # The in-memory snapshot schedule's moves (default settings: at most 3% of training time).
        "snapshot_intervals": [
            (e["step"], e.get("interval"), str(e.get("message", ""))[:300])
            for e in events
            if e["event"] == "snapshots"
        ],
        # Each window the schedule measured (moved or not): its costs, and how many probes it compared.
        "snapshot_windows": [
            {k: v for k, v in e.items() if k not in ("event", "time", "message")}
            for e in events
            if e["event"] == "snapshot_costs"
        ],
        # Where the recovery's time went: failure event -> restart's attempt_started -> first step.
        "failure_to_restart_s": event_time(restart) - event_time(failure),
        "restart_setup_s": restart.get("setup_s"),
        "restart_load_s": restart.get("load_s"),
        "restart_verify_s": restart.get("verify_s"),
        "restart_engine_s": restart.get("engine_s"),
        "restart_process_group_s": restart.get("process_group_s"),
        # Every event from the kill to the first step, seconds after the kill: where the rest went.
        "timeline": [
            (round(event_time(e) - t_fail, 2), e["event"], str(e.get("message", ""))[:160])
            for e in events
            if t_fail <= event_time(e) <= event_time(first)
        ],
    }


def elastictrain_worker_killed(w: Workload, tmp: Path, *extra: str) -> dict[str, Any]:
    import ray

    from elastictrain.testing.chaos import at_step, chain, wait_until_replacements_are_warm

    baselines.ensure_local_ray()
    s = schedule(w)
    t_fail: list[float] = []

    def kill(controller: Any) -> None:
        t_fail.append(time.time())
        ray.kill(controller.active[-1].actor)

    cfg = load(
        config_overrides(
            w,
            tmp,
            "scaling.min_workers=1",
            "scaling.max_workers=2",
            f"checkpoint.every_steps={s['every']}",
            *extra,
        )
    )
    hooks = [at_step(s["at"], kill)]
    if s["at"] + 2 < w.steps:
        hooks.append(at_step(s["at"] + 1, wait_until_replacements_are_warm))
    run_dir = run_elastictrain(cfg, chain(*hooks))
    return _elastictrain_outcome(run_dir, t_fail[0])


def elastictrain_node_lost(w: Workload, tmp: Path) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from elastictrain.testing.chaos import at_step, chain, wait_until_replacements_are_warm

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    s = schedule(w)
    try:
        t_fail: list[float] = []

        def remove(controller: Any) -> None:
            node_id = controller.active[-1].node_id
            t_fail.append(time.time())
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_id))

        def add(controller: Any) -> None:
            cluster.add_node(num_cpus=1)
            wait_until_replacements_are_warm(controller)

        cfg = load(
            config_overrides(
                w,
                tmp,
                "scaling.min_workers=2",
                "scaling.max_workers=3",
                f"checkpoint.every_steps={s['every']}",
            )
        )
        hooks = [at_step(s["at"], remove)]
        if s["at"] + 2 < w.steps:
            hooks.append(at_step(s["at"] + 1, add))
        run_dir = run_elastictrain(cfg, chain(*hooks))
        return _elastictrain_outcome(run_dir, t_fail[0])
    finally:
        ray.shutdown()
        cluster.shutdown()


# ---------------------------------------------------------------- peers
def peer_outcome(run: Any, hang_s: float) -> dict[str, Any]:
    """What a peer did after the failure, read from rank 0's step log across its restarts."""
    if run.kill is None:
        return {
            "outcome": "no failure injected (run ended first)",
            "death_to_first_step_s": None,
            "steps_lost": None,
        }
    t_kill = run.kill["time"]
    # The restart is the first attempt started after the failure; what rank 0 logged before it belongs
    # to the failed attempt (a step can finish on rank 0 just after another rank died).
    restart = next(
        (i for i, r in enumerate(run.steps) if r.get("event") == "attempt_start" and r["time"] > t_kill), None
    )
    cut = restart if restart is not None else len(run.steps)
    before = [r for r in run.steps[:cut] if "event" not in r]
    after = [r for r in run.steps[cut:] if "event" not in r]
    starts = [r for r in run.steps[cut:] if r.get("event") == "attempt_start"]
    errors = [r["error"] for r in run.steps if r.get("event") == "resume_failed"]
    last_done = max((r["step"] for r in before), default=0)
    out: dict[str, Any] = {
        "kill_step": run.kill.get("step"),
        "restarts": len(starts),
        "world_sizes_after": sorted({r["world_size"] for r in after}),
        "wall_s": run.wall_s,
    }
    if after:
        resumed_at = starts[0]["step"]
        out.update(
            outcome="recovered",
            death_to_first_step_s=after[0]["time"] - t_kill,
            steps_lost=last_done - resumed_at,
            resumed_at_step=resumed_at,
        )
    else:
        error = errors[-1] if errors else (run.driver_out or {}).get("error")
        if error is None and run.returncode is None:
            what = f"no step completed within {hang_s:.0f}s of the failure (stopped at that limit)"
        else:
            what = f"failed: {error or 'exit code ' + str(run.returncode)}"
        out.update(outcome=what, death_to_first_step_s=None, steps_lost=None)
    return out


def peer_worker_killed(system: str, w: Workload, tmp: Path, hang_s: float) -> dict[str, Any]:
    s = schedule(w)
    spec = {
        "kill_at_step": s["at"],
        "kill_rank": 1,
        "kill_marker": str(tmp / "kill.json"),
        "ckpt_every": s["every"],
        "max_failures": 1,
        "resume_dir": str(tmp / "ckpt"),
    }
    launch = {"max_restarts": 1} if system == "torchrun" else None
    run = run_peer(system, 2, w, tmp, spec_extra=spec, after_kill_timeout_s=hang_s, launch=launch)
    return peer_outcome(run, hang_s)


def peer_node_lost(system: str, w: Workload, tmp: Path, hang_s: float) -> dict[str, Any]:
    s = schedule(w)
    spec: dict[str, Any] = {
        "kill_at_step": s["at"] if system == "ray_train" else None,
        "kill_rank": 2,
        "kill_marker": str(tmp / "kill.json"),
        "ckpt_every": s["every"],
        "max_failures": 2,
        "resume_dir": str(tmp / "ckpt"),
        "min_workers": 2,
        "max_workers": 3,
    }
    if system == "ray_train":
        spec.update(cluster_nodes=3, nodes_dir=str(tmp / "nodes"))
        run = run_peer(system, 3, w, tmp, spec_extra=spec, after_kill_timeout_s=hang_s)
    else:
        # Three one-rank agents (the nodes); the harness kills the last agent's process group.
        launch = {"nnodes": "2:3", "nproc": 1, "max_restarts": 2, "kill_agent_at_step": s["at"]}
        run = run_peer(
            system, 3, w, tmp, spec_extra=spec, after_kill_timeout_s=hang_s, launch=launch, extra_procs=2
        )
    return peer_outcome(run, hang_s)


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    # Ray Train restarted in ~22 s on this machine, torchrun hung for 15 minutes: the limit sits well
    # above the former and keeps the latter's cost bounded; a loaded machine needs more.
    hang_s = 180.0 if smoke else 120.0
    scenarios: dict[str, dict[str, Any]] = {
        "worker_killed": {
            "elastictrain": lambda d: elastictrain_worker_killed(w, d),
            "ray_train": lambda d: peer_worker_killed("ray_train", w, d, hang_s),
        },
    }
    if not smoke:
        scenarios["worker_killed"]["torchrun"] = lambda d: peer_worker_killed("torchrun", w, d, hang_s)
        scenarios["node_lost"] = {
            "elastictrain": lambda d: elastictrain_node_lost(w, d),
            "ray_train": lambda d: peer_node_lost("ray_train", w, d, hang_s),
            "torchrun": lambda d: peer_node_lost("torchrun", w, d, hang_s),
        }
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for scenario, systems in scenarios.items():
            for system, fn in systems.items():
                out = fn(tmp / f"recovery-{scenario}-{system}-rep{rep}")
                if (scenario, system) == ("worker_killed", "elastictrain"):
                    LAST_ELASTICTRAIN.update(out)
                runs.append({"rep": rep, "scenario": scenario, "system": system, **out})
                print(f"  recovery rep {rep} {scenario} {system}: {out.get('outcome')} "
                      f"{out.get('death_to_first_step_s')}", flush=True)  # fmt: skip
        baselines.ensure_local_ray()
    metrics: dict[str, Any] = {}
    for scenario, systems in scenarios.items():
        metrics[scenario] = {}
        for system in systems:
            rows = [r for r in runs if r["scenario"] == scenario and r["system"] == system]
            ok = [r for r in rows if r["outcome"] == "recovered"]
            metrics[scenario][system] = {
                "death_to_first_step_s": median([r["death_to_first_step_s"] for r in ok]) if ok else None,
                "steps_lost": median([r["steps_lost"] for r in ok]) if ok else None,
                "recovered": f"{len(ok)}/{len(rows)}",
                "outcome": rows[-1]["outcome"],
            }
    wk = metrics["worker_killed"]
    et, ray_t = wk["elastictrain"], wk["ray_train"]
    LAST_RAY_TRAIN.update(ray_t)
    targets = [
        Target(
            "worker killed: recovery time elastictrain / Ray Train",
            ratio(et["death_to_first_step_s"], ray_t["death_to_first_step_s"]),
            0.15,
            "<=",
        ),
    ]
    if et["steps_lost"] is not None and ray_t["steps_lost"] is not None:
        targets.append(
            Target(
                "worker killed: steps lost, elastictrain (target: fewer than Ray Train's)",
                et["steps_lost"],
                max(ray_t["steps_lost"] - 1, 0),  # fewer, or none when Ray Train lost none
                "<=",
                unit="steps",
                note=f"Ray Train lost {ray_t['steps_lost']}",
            )
        )
    notes = [
        "death_to_first_step_s: from the kill (or node removal) to the first step completed after it.",
        "steps_lost: steps completed before the failure that were trained again after it.",
        "The peers cannot reshard a ZeRO-3 checkpoint: after a node loss they restart at the new size "
        "from a checkpoint of the old one; `outcome` says what they did.",
    ]
    if smoke:
        notes.append("smoke: worker killed only, elastictrain and Ray Train.")
    info = {**workload_info(w), **schedule(w), "peer_hang_limit_s": hang_s}
    return Result("recovery", smoke, reps, metrics, targets, runs, notes, info)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    fig, axes = plt.subplots(1, len(m), figsize=(4 * len(m), 3.2), squeeze=False)
    for ax, (scenario, systems) in zip(axes[0], m.items(), strict=True):
        names = list(systems)
        vals = [systems[s]["death_to_first_step_s"] or 0 for s in names]
        bars = ax.bar(names, vals, color=["C0", "C2", "C4"][: len(names)])
        for b, s in zip(bars, names, strict=True):
            if systems[s]["death_to_first_step_s"] is None:
                ax.annotate(
                    "no recovery", (b.get_x() + b.get_width() / 2, 0), ha="center", va="bottom", fontsize=8
                )
        ax.set_title(scenario.replace("_", " "))
        ax.set_ylabel("s from failure to next step")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
