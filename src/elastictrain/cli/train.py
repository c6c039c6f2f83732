"""CLI commands `train` and `resume`: load and check the config, take the run folder, start the run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from elastictrain.cli.output import fail as _fail
from elastictrain.cli.output import out


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


def _llamafactory_starts_over(config_path: Path | None, overrides: list[str]) -> bool:
    """A LLaMA-Factory file's overwrite_output_dir: true, which is `--fresh` (the old run moved aside)."""
    if config_path is None:
        return False
    from omegaconf import OmegaConf

    from elastictrain.config.llamafactory import is_llamafactory, translate

    raw = OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)
    return is_llamafactory(raw) and translate(raw, overrides).fresh  # type: ignore[arg-type]


def _finish(summary) -> None:  # noqa: ANN001
    if summary.status.value != "FINISHED":
        _fail(f"run ended {summary.status.value}: {summary.message}", code=1)


def _train(cfg, run_dir, **kwargs) -> None:  # noqa: ANN001, ANN003
    """run_training, with what the checks on the cluster's nodes find said as an error (no traceback)."""
    from elastictrain.driver.launch import run_training
    from elastictrain.driver.preflight import PreflightError

    try:
        summary = run_training(cfg, run_dir, **kwargs)
    except PreflightError as e:
        _fail(str(e))
    _finish(summary)


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
    from elastictrain.config import to_printed_yaml

    cfg = _load(config, overrides or [])
    starts_over = _llamafactory_starts_over(config, overrides or [])
    if print_config:
        if starts_over:
            out.print(
                "# overwrite_output_dir: true in the LLaMA-Factory file: train this with --fresh",
                markup=False,
            )
        out.print(to_printed_yaml(cfg), markup=False)
        return
    fresh = fresh or starts_over
    from elastictrain.driver.launch import RunFolderConflict, finished_run_of, prepare_run_dir
    from elastictrain.rundir.run_dir import RunDirError

    _lock_run_dir(cfg.run.dir)  # before the folder is created, moved (--fresh) or resumed
    # Counting the training set builds the dataset: its code is checked first.
    counts_samples = cfg.training.num_epochs is not None and cfg.training.epoch_samples is None
    if counts_samples:
        _check_user_code(cfg)
    _resolve_length(cfg)  # epochs to steps, before config.yaml and its digest are written
    try:
        done = None if fresh else finished_run_of(cfg)
    except RunDirError as e:
        _fail(str(e))
    if done is not None:  # a retried job of a finished run: nothing to train, check or start
        _say_continuing(done.path)
        out.print(f"the run already finished at step {done.read_info().last_step}; nothing to do")
        return
    if not counts_samples:
        _check_user_code(cfg)
    if not local:
        _check_ray_address(address or cfg.ray.address)
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
        _say_continuing(run_dir.path)
    _train(cfg, run_dir, address=address, tracking=not no_tracking, local=local)


def _say_continuing(path: object) -> None:
    out.print(f"run.dir {path} already holds this run: continuing it (use --fresh to start over)")


def _lock_run_dir(path: Path | str) -> None:
    """Take the run folder for this process's life (the OS releases it when the process ends)."""
    from elastictrain.rundir.lock import RunFolderBusy, hold_for_process

    try:
        hold_for_process(path)
    except RunFolderBusy as e:
        _fail(str(e))


def _check_ray_address(address: str | None) -> None:
    import os

    from elastictrain.driver.preflight import PreflightError, check_ray_address

    try:
        check_ray_address(address or os.environ.get("RAY_ADDRESS"))
    except PreflightError as e:
        _fail(str(e))


def _resolve_length(cfg) -> None:  # noqa: ANN001
    """training.num_epochs and warmup_ratio as fixed step counts (driver/launch.py), said as computed."""
    from elastictrain.config import ConfigError
    from elastictrain.driver.launch import resolve_length

    try:
        for line in resolve_length(cfg):
            out.print(line, markup=False)
    except (ConfigError, ValueError) as e:
        _fail(f"invalid configuration:\n{e}")


def _check_user_code(cfg) -> None:  # noqa: ANN001
    from elastictrain.config import ConfigError
    from elastictrain.driver.launch import check_before_start
    from elastictrain.user_code import UserCodeError

    try:
        check_before_start(cfg)
    except ConfigError as e:
        _fail(f"invalid configuration:\n{e}")
    except UserCodeError as e:
        _fail(str(e))


def resume(
    run_dir: Annotated[str, typer.Argument(help="the run folder (run.dir) of a stopped or crashed run")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="changes safe mid-run, e.g. training.max_steps=200 scaling.max_workers=4"),
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    ] = None,
    no_tracking: Annotated[bool, typer.Option("--no-tracking", help="do not log to MLflow")] = False,
    local: Annotated[bool, typer.Option("--local", help="one worker in this process, without Ray")] = False,
) -> None:
    """Continue a run from its latest committed checkpoint, into the same MLflow run.

    Overrides may change what is safe mid-run (training.max_steps or training.num_epochs to extend a run,
    scaling.*, checkpoint.*, failure.*, tracking.*, the ZeRO stage and offload, training.precision between
    fp32 and bf16); others are refused by name.
    """
    from elastictrain.config import ConfigError, load_config
    from elastictrain.driver.launch import apply_resume_changes
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
