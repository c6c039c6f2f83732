"""Helpers for integration tests: tiny configs and running a config on the connected Ray cluster."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from elastictrain.testing.chaos import (  # noqa: F401
    after_attempt_start,
    at_step,
    chain,
    record_losses,
    wait_until_replacements_are_warm,
)

REPO = Path(__file__).resolve().parents[2]
# The folders of the modules this suite's runs hand their workers code from: functions of the test
# modules given to fit, and examples' objects (imported as `hf_causal_lm.…`). conftest.py puts them on
# PYTHONPATH before any cluster starts.
TEST_MODULE_ROOTS = (str(REPO / "tests" / "integration"), str(REPO / "examples"))
TINY = REPO / "conf" / "tiny-cpu.yaml"


# The next run of this driver within 5 minutes takes this run's warm workers (warm_pool.py): a worker's
# start, imports and first engine build are 8-10 CPU s on 2 cores, while a parked one costs an idle
# actor's 1% of a core. Five, not one: the modules that test on probe actors between two modules of runs
# take minutes. test_warm_workers.py shows a taken worker trains as a new one. Every run in this process
# that may leave its workers to the next sets it (tiny_config's, and the examples' runs in tests).
KEEP_WARM = "scaling.keep_warm_s=300"


def tiny_config(run_dir: Path, *overrides: str):  # noqa: ANN201 - elastictrain.config.Config
    from elastictrain.config import load_config

    base = [
        f"run.dir={run_dir}",
        "training.max_steps=12",
        "training.global_batch_size=12",
        "training.micro_batch_size=2",
        "training.warmup_steps=2",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=2",
        "data.generated_chars=120000",
        "failure.hang_timeout_s=60",
        "failure.collective_timeout_s=60",
        "failure.wait_for_capacity_s=20",
        # A replacement that does not finish starting (once 199 s in a loaded suite) is stopped and started
        # again after two minutes, or three times the slowest start, instead of holding a test; a cold
        # start on a loaded 2-core machine takes up to about a minute, so none that progresses is stopped.
        "failure.warmup_timeout_s=120",
        # Plots and system metrics cost every run seconds; test_validation_run.py turns them on.
        "tracking.plots=false",
        "tracking.system_metrics=false",
        KEEP_WARM,
    ]
    return load_config(TINY, [*base, *overrides])


def interrupt_after(step: int):  # noqa: ANN201
    """A controller hook that stops the driver (as Ctrl-C would) once `step` steps are done."""

    def stop(controller) -> None:  # noqa: ANN001
        raise KeyboardInterrupt

    return at_step(step, stop)


def quiet_reporter(total: int):  # noqa: ANN201
    from elastictrain.control.progress import Reporter

    return Reporter(total, stream=io.StringIO(), live=False)


def run(config, *, tracking: bool = True, hook=None, faults: bool = False):  # noqa: ANN001, ANN201
    """Train a config in this process (the driver), on the Ray cluster already connected. `faults`: the
    workers take injected faults (FaultyTrainWorker); otherwise they are the product's TrainWorker, as
    CLI and `elastictrain.fit` runs host, so the warm workers a run parks serve the next run whichever
    way it starts (a pool serves only its own class: a switch costs every worker a cold start)."""
    from elastictrain.driver.launch import prepare_run_dir, run_training
    from elastictrain.testing.faulty_worker import FaultyTrainWorker

    run_dir, _ = prepare_run_dir(config, fresh=False)
    reporter = quiet_reporter(config.training.max_steps)
    summary = run_training(
        config,
        run_dir,
        tracking=tracking,
        reporter=reporter,
        controller_hook=hook,
        worker_class=FaultyTrainWorker if faults else None,
    )
    return summary, run_dir, reporter.stream.getvalue()


# DeepSpeed swaps only tensors of at least 1 MiB to NVMe. With these sizes the embedding, the LM head
# and each rank's optimizer partition exceed that at world sizes 1 to 3, so NVMe tests really swap.
NVME_MODEL = (
    "model.hf_config.vocab_size=8192",
    "model.hf_config.hidden_size=128",
    "model.hf_config.intermediate_size=256",
)


def offload_overrides(offload: str, nvme_path: Path) -> list[str]:
    out = [
        f"deepspeed.offload_optimizer={offload}",
        f"deepspeed.offload_param={offload}",
        f"deepspeed.nvme_path={nvme_path}",
    ]
    return out + list(NVME_MODEL) if offload == "nvme" else out


def script_on_two_ranks(script: str, *args: str, timeout_s: float = 300) -> list[dict]:
    """Run a `python -c` script as ranks 0 and 1 of a gloo world on loopback; each rank's last stdout
    line, parsed as JSON. The script gets its port, its rank, then `args` in sys.argv."""
    import json
    import os
    import subprocess
    import sys

    from readme_blocks import free_ports

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    port = str(free_ports(1)[0])
    # A script that got to its end leaves at once: the interpreter's teardown of a live gloo group whose
    # peer has already exited can abort the process ("terminate called without an active exception",
    # seen once in a full suite run), and that teardown is not what these scripts test.
    script += "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)\n"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, port, str(rank), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    try:
        for proc in ranks:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in ranks:
            proc.kill()
    return outs


def three_ranks(ctx, target, *args, timeout_s: float = 120) -> dict:  # noqa: ANN001
    """Run target(rank, port, *args, out) in 3 processes of the multiprocessing context `ctx`; each puts
    (rank, result) on `out`. The results by rank; the processes are killed after."""
    from readme_blocks import free_ports

    out = ctx.Queue()
    (port,) = free_ports(1)
    procs = [ctx.Process(target=target, args=(r, port, *args, out), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout_s) for _ in range(3))
    finally:
        for p in procs:
            p.kill()


def multi_node_cluster(cpus_per_node: int) -> Any:
    """A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head with no CPUs
    and three worker nodes of `cpus_per_node`, all up. Workers can only land on the worker nodes, so
    removing one is a real node failure for them. On loopback, no dashboard, and no process that nothing
    here reads: its nodes run without a log monitor (every driver here connects with log_to_driver=False:
    the workers' logs stay in their files) and the head without the autoscaler's monitor (nothing
    autoscales a Cluster): about 1 CPU s a node, and as much for the monitor, that the suite's other
    tests get."""
    from ray.cluster_utils import Cluster

    from elastictrain.cluster.connect import LOCAL_SYSTEM_CONFIG

    class QuietCluster(Cluster):
        def add_node(self, wait: bool = True, **node_args: Any) -> Any:
            return super().add_node(wait, **{"include_log_monitor": False, **node_args})

    cluster = QuietCluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "no_monitor": True,
            "_system_config": LOCAL_SYSTEM_CONFIG,
        },
    )
    for _ in range(3):
        cluster.add_node(num_cpus=cpus_per_node)
    cluster.wait_for_nodes()
    return cluster
