"""elastictrain's command line: train, resume, status, runs, verify, reshard, export (more in cli_*.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from elastictrain.cli_data import prepare_data_command
from elastictrain.cli_eval import eval_lines, evaluate_command
from elastictrain.cli_export import export_command
from elastictrain.cli_mlflow import plot_command
from elastictrain.cli_output import choose as _choose
from elastictrain.cli_output import err, out
from elastictrain.cli_output import fail as _fail
from elastictrain.cli_preview import preview_data_command
from elastictrain.redact import install_exception_redaction

# typer's own traceback printer would show locals (a config holding a token): ours masks instead.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Elastic training on Ray with DeepSpeed ZeRO-3.",
    pretty_exceptions_enable=False,
)
install_exception_redaction()
app.command("eval")(evaluate_command)
app.command("prepare-data")(prepare_data_command)
app.command("preview-data")(preview_data_command)
app.command("plot")(plot_command)
app.command("export")(export_command)


def _load(config_path: Path | None, overrides: list[str]):  # noqa: ANN202 - Config, imported lazily
    from elastictrain.config import ConfigError, load_config

    if config_path is not None and config_path.is_dir():
        _fail(f"--config: {config_path} is a directory; give a YAML file such as conf/tiny-cpu.yaml")
    if config_path is not None and not config_path.is_file():
        _fail(f"--config: {config_path} does not exist; give a YAML file such as conf/tiny-cpu.yaml")
    try:
        return load_config(config_path, overrides)
    except ConfigError as e:
        _fail(f"invalid configuration:\n{e}")


def _finish(summary) -> None:  # noqa: ANN001
    if summary.status.value != "FINISHED":
        _fail(f"run ended {summary.status.value}: {summary.message}", code=1)


def _train(cfg, run_dir, **kwargs) -> None:  # noqa: ANN001, ANN003
    """run_training, with what the checks on the cluster's nodes find said as an error (no traceback)."""
    from elastictrain.launch import run_training
    from elastictrain.preflight import PreflightError

    try:
        summary = run_training(cfg, run_dir, **kwargs)
    except PreflightError as e:
        _fail(str(e))
    _finish(summary)


@app.command()
def train(
    overrides: Annotated[
        list[str] | None, typer.Argument(help="dotlist overrides, e.g. training.max_steps=5")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML config (e.g. conf/tiny-cpu.yaml)")
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    ] = None,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="print the resolved config and exit")
    ] = False,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="start over even if run.dir holds a run (moved aside)")
    ] = False,
    no_tracking: Annotated[bool, typer.Option("--no-tracking", help="do not log to MLflow")] = False,
    local: Annotated[
        bool, typer.Option("--local", help="one worker in this process, without Ray (for debugging)")
    ] = False,
) -> None:
    """Train (or continue the run already in run.dir with the same config)."""
    from elastictrain.config import to_yaml

    cfg = _load(config, overrides or [])
    if print_config:
        out.print(to_yaml(cfg), markup=False)
        return
    from elastictrain.launch import RunFolderConflict, prepare_run_dir

    _lock_run_dir(cfg.run.dir)  # before the folder is created, moved (--fresh) or resumed
    _check_user_code(cfg)
    _resolve_length(cfg)  # epochs to steps, before config.yaml and its digest are written
    if not local:
        _check_ray_address(address or cfg.ray.address)
    from elastictrain.rundir.run_dir import RunDirError

    try:
        run_dir, resumed = prepare_run_dir(cfg, fresh=fresh)
    except (RunFolderConflict, RunDirError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(
            f"run.dir: got {cfg.run.dir!r}; cannot create the run folder there ({e}); "
            "expected a path this user can write"
        )
    if resumed:
        out.print(f"run.dir {run_dir.path} already holds this run: continuing it (use --fresh to start over)")
        done = run_dir.read_info()
        if done.status == "FINISHED":  # a retried job of a finished run: nothing to train, no cluster
            out.print(f"the run already finished at step {done.last_step}; nothing to do")
            return
    _train(cfg, run_dir, address=address, tracking=not no_tracking, local=local)


def _lock_run_dir(path: Path | str) -> None:
    """Take the run folder for this process's life (the OS releases it when the process ends)."""
    from elastictrain.rundir.lock import RunFolderBusy, hold_for_process

    try:
        hold_for_process(path)
    except RunFolderBusy as e:
        _fail(str(e))


def _check_ray_address(address: str | None) -> None:
    import os

    from elastictrain.preflight import PreflightError, check_ray_address

    try:
        check_ray_address(address or os.environ.get("RAY_ADDRESS"))
    except PreflightError as e:
        _fail(str(e))


def _resolve_length(cfg) -> None:  # noqa: ANN001
    """training.num_epochs and warmup_ratio as fixed step counts (run_length.py), said as computed."""
    from elastictrain.config import ConfigError
    from elastictrain.run_length import resolve_length

    try:
        for line in resolve_length(cfg):
            out.print(line, markup=False)
    except (ConfigError, ValueError) as e:
        _fail(f"invalid configuration:\n{e}")


def _check_user_code(cfg) -> None:  # noqa: ANN001
    from elastictrain.config import ConfigError
    from elastictrain.launch import check_before_start
    from elastictrain.user_code import UserCodeError

    try:
        check_before_start(cfg)
    except ConfigError as e:
        _fail(f"invalid configuration:\n{e}")
    except UserCodeError as e:
        _fail(str(e))


@app.command()
def resume(
    run_dir: Annotated[str, typer.Argument(help="the run folder (run.dir) of a stopped or crashed run")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="changes safe mid-run, e.g. training.max_steps=200 scaling.max_workers=4"),
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    ] = None,
    no_tracking: Annotated[bool, typer.Option("--no-tracking")] = False,
    local: Annotated[bool, typer.Option("--local", help="one worker in this process, without Ray")] = False,
) -> None:
    """Continue a run from its latest committed checkpoint, into the same MLflow run.

    Overrides may change what is safe mid-run (training.max_steps or training.num_epochs to extend a run,
    scaling.*, checkpoint.*, failure.*, tracking.*, the ZeRO stage and offload, training.precision between
    fp32 and bf16); others are refused by name.
    """
    from elastictrain.config import ConfigError, load_config
    from elastictrain.launch import apply_resume_changes
    from elastictrain.rundir.run_dir import RunDir, RunDirError

    _lock_run_dir(run_dir)
    try:
        rd = RunDir.open(run_dir)
        cfg = load_config(rd.config_yaml, overrides or [])
        _resolve_length(cfg)  # training.num_epochs=N: max_steps from the epoch_samples recorded at start
        if overrides:
            for line in apply_resume_changes(rd, cfg):
                out.print(line)
    except (RunDirError, ConfigError) as e:
        _fail(str(e))
    if rd.read_info().status == "FINISHED" and rd.read_info().last_step >= cfg.training.max_steps:
        out.print(f"{run_dir}: the run already finished at step {rd.read_info().last_step}; nothing to do")
        return
    _check_user_code(cfg)
    if not local:
        _check_ray_address(address or cfg.ray.address)
    _train(cfg, rd, address=address, tracking=not no_tracking, local=local)


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
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


@app.command("build-ops")
def build_ops_command(
    gpu: Annotated[bool, typer.Option("--gpu", help="build for the GPU accelerator")] = False,
) -> None:
    """Compile DeepSpeed's ops (CPU Adam, async I/O for NVMe offload, shared-memory comm) once."""
    from elastictrain.worker.ops import build_ops

    for name, state in build_ops(use_gpu=gpu).items():
        out.print(f"{name:<22} {state}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
