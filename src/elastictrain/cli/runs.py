"""CLI commands about run folders and checkpoints: status, runs, verify, sync, reshard, and build-ops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from elastictrain.cli.eval import eval_lines
from elastictrain.cli.output import choose as _choose
from elastictrain.cli.output import fail as _fail
from elastictrain.cli.output import out


def status(run_dir: Annotated[str, typer.Argument(help="a run folder (a path or an s3:// URL)")]) -> None:
    """Show a run's state, world-size history, checkpoints, last metrics and MLflow run."""
    from elastictrain.rundir.run_dir import RunDir, RunDirError

    try:
        rd = RunDir.open(run_dir)
    except RunDirError as e:
        _fail(str(e))
    info = rd.read_info()
    out.print(
        f"run       {info.name} ({info.run_id})\nstatus    {info.status}"
        + (f": {info.message}" if info.message else "")
    )
    from elastictrain.rundir.liveness import driver_state

    driver = driver_state(info.extra.get("driver"), info.status, str(run_dir))
    if driver is not None:
        out.print(f"driver    {driver.text}")
    out.print(f"step      {info.last_step}\nfailures  {info.failures}")
    for slow in info.extra.get("stragglers", [])[-3:]:  # the latest named (events.jsonl: straggler)
        out.print(
            f"straggler rank {slow['rank']} (worker {slow['worker']}, node {str(slow['node'])[:12]}) at step "
            f"{slow['step']}: {slow['ratio']}x the others"
        )
    if info.skipped_steps:  # steps not applied: a non-finite loss or gradient (events.jsonl: bad_step)
        out.print(f"skipped   {info.skipped_steps} step(s) not applied (non-finite loss or gradients)")
    rollbacks = info.extra.get("rollbacks", [])
    if rollbacks:  # events.jsonl: rollback
        out.print(f"rollbacks {len(rollbacks)}, the last over step(s) {', '.join(map(str, rollbacks[-1]))}")
    from elastictrain.tracking.tracker import resolve_tracking_uri

    stored_uri = info.mlflow_tracking_uri
    shown_uri = resolve_tracking_uri(stored_uri, rd.local_dir) if stored_uri else None
    out.print(f"mlflow    run {info.mlflow_run_id} at {shown_uri}")
    out.print(
        "world size history: "
        + ", ".join(
            f"{h['world_size']} from step {h['step']} ({h['reason']})" for h in info.world_size_history
        )
    )
    from elastictrain.checkpoint.choice import newest_usable

    usable = newest_usable(rd.checkpoints_dir)
    latest = usable.resume_tag
    out.print(f"checkpoints: {', '.join(usable.committed) or 'none'} (latest: {latest or '-'})")
    for line in usable.passed_over:
        out.print(f"  not used: {line}; a resume loads {latest or 'no checkpoint (starts at step 0)'}")
    out.print("last metrics: " + json.dumps(info.last_metrics))
    for line in eval_lines(info.extra):
        out.print(line, markup=False)  # the model's own text may hold [brackets]


def runs(
    root_arg: Annotated[str, typer.Argument(metavar="ROOT", help="folder holding run folders")] = "runs",
) -> None:
    """List the runs under a folder (a path or an s3:// URL)."""
    from elastictrain.rundir.run_dir import list_runs
    from elastictrain.storage import as_path

    root = as_path(root_arg)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        _fail(f"{root} {what}; give the folder holding run folders (e.g. runs)")
    found = list_runs(root)
    if not found:
        out.print(f"no runs under {root}")
    from elastictrain.rundir.liveness import ACTIVE_STATUSES, driver_state

    for path, info in found:
        driver = driver_state(info.extra.get("driver"), info.status)
        orphaned = info.status in ACTIVE_STATUSES and driver is not None and driver.alive is False
        note = "  (driver not running: resume it)" if orphaned else ""
        out.print(f"{info.status:<10} step {info.last_step:<6} {info.name:<20} {path}{note}")


def verify(
    checkpoint: Annotated[str, typer.Argument(help="a checkpoint folder, checkpoints/ folder or run folder")],
) -> None:
    """Check every file of a checkpoint against the sizes and sha256 in its manifest."""
    from elastictrain.checkpoint.store import verify_checkpoint

    path = _choose(checkpoint)
    problems = verify_checkpoint(path)
    if problems:
        _fail(f"{path} does not verify:\n" + "\n".join(problems), code=1)
    out.print(f"{path}: every file matches its manifest")


def sync(
    run_dir: Annotated[str, typer.Argument(help="a run folder (run.dir)")],
    timeout: Annotated[float, typer.Option(help="seconds to wait for the tracking server")] = 60.0,
) -> None:
    """Send to MLflow what a run spooled while its tracking server was unreachable (in order, once)."""
    from elastictrain.config import ConfigError, load_config
    from elastictrain.redact import redact_text
    from elastictrain.rundir.run_dir import RunDir, RunDirError
    from elastictrain.tracking.run_tracker import run_tracker, tracking_uri_of
    from elastictrain.tracking.spool import SPOOL_DIR
    from elastictrain.tracking.tracker import TrackerError, resolve_tracking_uri

    try:
        rd = RunDir.open(run_dir)
        cfg = load_config(rd.config_yaml)
    except (RunDirError, ConfigError) as e:
        _fail(str(e))
    if not (rd.local_dir / SPOOL_DIR).is_dir():
        out.print(f"{run_dir}: nothing spooled; MLflow has everything this run logged")
        return
    info = rd.read_info()
    # The URI the run used (run.json's) first: config.yaml's has its password masked.
    stored = info.mlflow_tracking_uri
    uri = resolve_tracking_uri(stored, rd.local_dir) if stored else tracking_uri_of(rd, cfg.tracking.uri)
    tracker = run_tracker(
        rd, uri, cfg.tracking.experiment, start_wait_s=0.0, max_spool_mb=cfg.tracking.max_spool_mb
    )
    try:
        tracker.start()
    except TrackerError as e:
        _fail(str(e))
    try:
        pending = tracker.spooled
        sent = tracker.flush(timeout)
        terminal = {"FINISHED": "FINISHED", "FAILED": "FAILED", "STOPPED": "KILLED"}.get(info.status)
        if sent and terminal:
            tracker.finish(terminal, timeout_s=timeout)  # the driver could not say how the run ended
        left = tracker.spooled
    finally:
        tracker.close()
    if not sent or left:
        _fail(
            f"MLflow at {redact_text(uri)} did not take everything within {timeout:.0f}s; {left} record(s) "
            f"stay spooled in {rd.local_dir / SPOOL_DIR}; run `elastictrain sync {run_dir}` again when it "
            "answers",
            code=1,
        )
    out.print(
        f"{run_dir}: sent {pending} spooled record(s) to MLflow run {tracker.run_id} at {redact_text(uri)}"
    )


def reshard(
    checkpoint: Annotated[str, typer.Argument(help="a checkpoint folder, checkpoints/ folder or run folder")],
    world_size: Annotated[
        int, typer.Option("--world-size", help="the world size to lay the checkpoint out for")
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="output folder (default: CHECKPOINT.wsM): new, empty, or an earlier reshard output",
        ),
    ] = None,
) -> None:
    """Rewrite a checkpoint as the ZeRO-3 partitions of another world size (training never needs this)."""
    from elastictrain.checkpoint.store import CheckpointError, verify_checkpoint
    from elastictrain.tools.reshard import reshard_checkpoint

    path = _choose(checkpoint)
    try:
        problems = verify_checkpoint(path)
        if problems:
            _fail(f"{path} does not verify, not resharding it:\n" + "\n".join(problems), code=1)
        written = reshard_checkpoint(path, world_size, out_dir)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    out.print(f"resharded {path} for world size {world_size}: {written}")


def build_ops_command(
    gpu: Annotated[bool, typer.Option("--gpu", help="build for the GPU accelerator")] = False,
) -> None:
    """Compile DeepSpeed's ops (CPU Adam, async I/O for NVMe offload, shared-memory comm) once."""
    from elastictrain.compat.deepspeed.ops import build_ops

    for name, state in build_ops(use_gpu=gpu).items():
        out.print(f"{name:<22} {state}")
