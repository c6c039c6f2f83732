"""CLI pieces that put files in a run's MLflow run: `plot` (PNGs of its metrics), `export --log-to-mlflow`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from elastictrain.cli.output import fail, out


def plot_command(
    run_dir: Annotated[Path, typer.Argument(help="a run folder")],
    no_log: Annotated[
        bool, typer.Option("--no-log", help="write the PNGs only, do not log them to MLflow")
    ] = False,
) -> None:
    """Plot loss and validation loss, learning rate, throughput, world size (failures, resizes marked)."""
    from elastictrain.config import ConfigError, load_config
    from elastictrain.rundir.run_dir import RunDir, RunDirError
    from elastictrain.tools.plots import plot_run

    try:
        rd = RunDir.open(run_dir)
        cfg = load_config(rd.config_yaml)
        written = plot_run(rd, cfg.tracking.uri, log=not no_log)
    except (RunDirError, ConfigError, ValueError) as e:
        fail(str(e))
    where = "" if no_log else f" and in MLflow run {rd.read_info().mlflow_run_id} under plots/"
    out.print(f"wrote {', '.join(str(p) for p in written)}{where}")


def log_export(checkpoint: Path, folder: Path) -> None:
    """Log an exported model folder (Hugging Face format) to the MLflow run of the checkpoint's run."""
    from elastictrain.config import ConfigError, load_config
    from elastictrain.rundir.run_dir import RunDir, RunDirError
    from elastictrain.tracking.artifacts import NoMlflowRun, log_folder

    run_path = checkpoint.resolve().parent.parent  # RUN_DIR/checkpoints/step-NNNNNN
    artifact = f"model/{checkpoint.name}"
    try:
        rd = RunDir.open(run_path)
        cfg = load_config(rd.config_yaml)
        run_id = log_folder(rd, cfg.tracking.uri, folder, artifact)
    except (RunDirError, ConfigError, NoMlflowRun) as e:
        fail(f"--log-to-mlflow: {checkpoint} is not in a run folder with an MLflow run ({e})")
    out.print(f"logged {folder} to MLflow run {run_id} as {artifact} (Hugging Face format)")
