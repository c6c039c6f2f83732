"""Wires one run together on the driver: Ray connection, run folder, MLflow, worker group, controller.

With `local=True` the run has one worker in this process instead (cluster/local_group.py), driven by
the same control loop, and nothing here imports Ray.

Before the run folder is made, training.num_epochs and warmup_ratio become fixed step counts
(`resolve_length`; the arithmetic is core/run_length.py, the config's pairs config/length.py): the
training set is counted here, on the driver, before any worker exists.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastictrain.config import Config, config_digest, to_flat_dict, to_yaml, validate
from elastictrain.config.pipeline_check import fixed_stages
from elastictrain.control.progress import Reporter
from elastictrain.core.run_length import epoch_length, warmup_for_ratio
from elastictrain.rundir.run_dir import RunDir
from elastictrain.storage import as_path, storage_of
from elastictrain.tracking.artifacts import SystemMetrics
from elastictrain.tracking.run_tracker import run_tracker, tracking_uri_of
from elastictrain.tracking.tracker import NullTracker, Tracker, stored_tracking_uri

if TYPE_CHECKING:
    from elastictrain.control.loop import RunSummary

log = logging.getLogger("elastictrain.launch")


def training_samples(config: Config) -> tuple[int, int]:
    """(samples training reads, samples held out for validation by eval.split), counted on this process."""
    from elastictrain.data.eval_data import train_and_eval_datasets

    train, held = train_and_eval_datasets(config)
    return len(train), (len(held) if held is not None and config.eval.data is None else 0)


def resolve_length(config: Config) -> list[str]:
    """Turn num_epochs and warmup_ratio into max_steps and warmup_steps, in place; what was computed.

    Counts the training set when num_epochs has no epoch_samples yet (builds the dataset here). Call it
    before the run folder is made or resumed, so that config.yaml and its digest hold the numbers.
    """
    t, lines = config.training, []
    if t.num_epochs is not None:
        if t.epoch_samples is None:
            samples, held = training_samples(config)
            t.epoch_samples = samples
            if held:
                lines.append(f"eval.split={config.eval.split:g} holds out {held} of {samples + held} samples")
        length = epoch_length(t.num_epochs, t.epoch_samples, t.global_batch_size)
        t.max_steps = length.steps
        lines.append(length.describe())
    if t.warmup_ratio is not None:
        t.warmup_steps = warmup_for_ratio(t.warmup_ratio, t.max_steps)
        lines.append(
            f"training.warmup_ratio={t.warmup_ratio:g}: {t.warmup_steps} warmup steps of {t.max_steps} "
            "(training.warmup_steps, rounded up; kept if the run is extended)"
        )
        t.warmup_ratio = None  # now a fixed number: config.yaml holds warmup_steps alone
    if lines:  # warmup_steps against the computed max_steps, and the rest again
        validate(config)
    return lines


class RunFolderConflict(RuntimeError):
    pass


def prepare_run_dir(config: Config, *, fresh: bool) -> tuple[RunDir, bool]:
    """The run folder for `train`: new, or the existing run of the same config (resumed), or moved aside."""
    path = as_path(config.run.dir)
    digest = config_digest(config)
    if RunDir.exists(path):
        if fresh:
            aside = path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            storage_of(path).move_tree(path, aside)
            log.warning("moved the previous run folder to %s", aside)
        else:
            run_dir = RunDir.open(path)
            info = run_dir.read_info()
            if info.config_digest != digest:
                raise RunFolderConflict(
                    f"run.dir {path} holds a run of another config ({_differences(run_dir, config)}); "
                    f"use `elastictrain resume {path}` to continue it as it was, "
                    "`--fresh` to start over (the old folder is moved aside), or another run.dir"
                )
            return run_dir, True
    return RunDir.create(path, name=config.run.name, config_yaml=to_yaml(config), config_digest=digest), False


def finished_run_of(config: Config) -> RunDir | None:
    """The run in run.dir when it is this config's and it finished: a retried job has nothing to train,
    so nothing to check or start either."""
    path = as_path(config.run.dir)
    if not RunDir.exists(path):
        return None
    run_dir = RunDir.open(path)
    info = run_dir.read_info()
    return run_dir if info.status == "FINISHED" and info.config_digest == config_digest(config) else None


def _differences(run_dir: RunDir, config: Config, most: int = 8) -> str:
    """The dotted keys in which `config` differs from the run's config.yaml, with both values."""
    from elastictrain.config import ConfigError, load_config

    try:
        before = to_flat_dict(load_config(run_dir.config_yaml))
    except (ConfigError, OSError) as e:
        return f"its config.yaml does not load: {e}"
    now = to_flat_dict(config)
    keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if not keys:
        return "the same settings, saved by another version of elastictrain"
    shown = [f"{k}: run has {before.get(k)!r}, config has {now.get(k)!r}" for k in keys[:most]]
    more = f"; and {len(keys) - most} more" if len(keys) > most else ""
    return "; ".join(shown) + more


def apply_resume_changes(run_dir: RunDir, config: Config) -> list[str]:
    """Take the overrides of `resume RUN_DIR key=value`: refuse unsafe ones, record the rest.

    The new config becomes the run's config.yaml and digest, and an event lists each change.
    Raises ConfigError naming every refused key.
    """
    from elastictrain.config import ConfigError, load_config
    from elastictrain.core.config_changes import classify_changes, extension_problem

    before = load_config(run_dir.config_yaml)
    changes = classify_changes(to_flat_dict(before), to_flat_dict(config))
    problems = [changes.refusal()] if changes.refused else []
    info = run_dir.read_info()
    extension = extension_problem(info.last_step, config.training.max_steps, config.training.num_epochs)
    problems += [extension] if extension else []
    if problems:
        raise ConfigError(problems)
    if not changes.allowed:
        return []
    storage_of(run_dir.config_yaml).replace_text(run_dir.config_yaml, to_yaml(config))
    run_dir.update(config_digest=config_digest(config))
    described = {k: {"from": a, "to": b} for k, (a, b) in changes.allowed.items()}
    run_dir.append_event("config_changed", step=info.last_step, changes=described)
    return [f"config changed on resume: {k}: {a} -> {b}" for k, (a, b) in changes.allowed.items()]


def make_tracker(config: Config, run_dir: RunDir, enabled: bool = True) -> Tracker:
    if not enabled:
        return NullTracker()
    info = run_dir.read_info()
    uri = tracking_uri_of(run_dir, config.tracking.uri)
    tracker = run_tracker(run_dir, uri, config.tracking.experiment, max_spool_mb=config.tracking.max_spool_mb)
    run_id = tracker.start()  # "" while the server does not answer: the run is created when it does
    if info.mlflow_run_id is None:
        if run_id:  # the URI without its password, if it held one (redact.py)
            run_dir.update(
                mlflow_run_id=run_id, mlflow_tracking_uri=stored_tracking_uri(uri, run_dir.local_dir)
            )
        tracker.log_params(to_flat_dict(config))
        tracker.log_artifact_text(to_yaml(config), "config.yaml")
    return tracker


def run_training(
    config: Config,
    run_dir: RunDir,
    *,
    address: str | None = None,
    tracking: bool = True,
    reporter: Reporter | None = None,
    controller_hook: Any = None,
    local: bool = False,
    worker_class: type | None = None,
) -> RunSummary:
    """Run (or continue) a run. Check its user code first: `check_before_start`.

    `local`: one worker in this process (cluster/local_group.py) instead of Ray actors, under the same
    control loop; nothing on that path imports Ray. `worker_class`: what hosts each worker instead of
    TrainWorker (a test's or chaos run's FaultyTrainWorker, testing/faulty_worker.py).
    """
    from elastictrain.control.loop import Controller

    reporter = reporter or Reporter(config.training.max_steps)
    degrees = layouts = stages = None
    if local:
        group: Any = _local_group(config, worker_class)
        config = local_config(config)
        layouts = _auto_layout(config, reporter, local=True)
    else:
        group, degrees, layouts, stages = _ray_group(config, run_dir, address, reporter, worker_class)
    tracker = make_tracker(config, run_dir, tracking)
    take_over(run_dir, reporter)
    system = SystemMetrics(config, run_dir) if tracking else None
    mlflow_run = run_dir.read_info().mlflow_run_id
    if not tracking:
        mlflow_run = "none (--no-tracking)"
    elif not mlflow_run:
        mlflow_run = "created when the tracker connects"
    where = "; one local worker in this process (no Ray)" if local else ""
    reporter.event(f"run folder {run_dir.path}; MLflow run: {mlflow_run}{where}")
    controller = Controller(
        config, run_dir, tracker, reporter, group, degrees=degrees, layouts=layouts, stages=stages
    )
    if controller_hook is not None:
        controller_hook(controller)
    summary = None
    try:
        summary = controller.run()
        if summary.status.value == "FINISHED":
            export_at_finish(config, run_dir, reporter)
        return summary
    finally:
        status = (
            "KILLED" if summary is None else ("FINISHED" if summary.status.value == "FINISHED" else "FAILED")
        )
        _end_tracking(config, run_dir, tracker, system, status, reporter if summary is not None else None)


def _auto_layout(config: Config, reporter: Reporter, *, local: bool) -> Any:
    """With auto layout fields: choose them now (PreflightError where nothing fits), print the choice
    and its estimate, and return what the control loop asks again at each world size."""
    from elastictrain.config.layout_check import auto_fields

    if not auto_fields(config):
        return None
    from elastictrain.driver.layout_auto import choose_at_start, rank_memory, rank_memory_here

    choice, chooser = choose_at_start(config, rank_memory_here(config) if local else rank_memory(config))
    for line in choice.lines():
        reporter.event(line)
    return chooser


def _ray_group(
    config: Config, run_dir: RunDir, address: str | None, reporter: Reporter, worker_class: type | None
) -> tuple[Any, Any, Any, Any]:
    """Connect to Ray, check every node can run the config (PreflightError if not): the worker group,
    with `tensor_parallel: auto` what chose the degree, with auto layout fields what chose them, and with
    `pipeline_parallel: auto` what chooses the stages (the control loop asks each again)."""
    from elastictrain.cluster.connect import connect_ray
    from elastictrain.cluster.worker_group import WorkerGroup
    from elastictrain.cluster.worker_resources import WorkerResources
    from elastictrain.driver.preflight import check_memory_on_nodes, check_nvme_on_nodes
    from elastictrain.user_code import imports_user_modules

    reporter.event(connect_ray(config, address))
    degrees = None
    if config.scaling.tensor_parallel == "auto":  # before anything reads the degree
        from elastictrain.driver.tensor_parallel_auto import choose_tensor_parallel

        said, degrees = choose_tensor_parallel(config)
        reporter.event(said)
    layouts = _auto_layout(config, reporter, local=False)  # before the memory check reads the stage
    stages = None
    if config.scaling.pipeline_parallel == "auto":
        from elastictrain.driver.pipeline_auto import choose_at_start

        said, stages = choose_at_start(config)
        reporter.event(said)
    # Both raise PreflightError before any worker or tracker exists.
    if check_nvme_on_nodes(config):
        reporter.event(f"deepspeed.nvme_path {config.deepspeed.nvme_path} is writable on every worker node")
    estimate = check_memory_on_nodes(config)
    if estimate is not None:
        reporter.event(estimate.describe())
    s = config.scaling
    # A warm process keeps the modules it imported, edited since or not.
    fresh = imports_user_modules(config)
    if fresh and s.keep_warm_s > 0:
        reporter.event("scaling.keep_warm_s: this run imports modules of yours, so its workers start new")
    group = WorkerGroup(
        WorkerResources(
            s.use_gpu,
            s.cpus_per_worker,
            s.gpus_per_worker,
            s.worker_allocator,
            # A replica's ranks, reserved together (under pipeline_parallel: auto, one by one).
            s.tensor_parallel * fixed_stages(config),
            # Pipeline stages may span nodes; tensor-parallel ranks (T > 1) share one.
            replica_spans_nodes=fixed_stages(config) > 1 and s.tensor_parallel == 1,
        ),
        name_prefix=run_dir.read_info().run_id[:6],
        keep_warm_s=0.0 if fresh else s.keep_warm_s,
        reuse_warm=not fresh,
        worker_class=worker_class,
    )
    return group, degrees, layouts, stages


def _local_group(config: Config, worker_class: type | None) -> Any:
    from elastictrain.cluster.local_group import LocalGroup

    # Ray workers' output is not shown; here, DeepSpeed's per-micro-step deprecation notice would be.
    warnings.filterwarnings(
        "ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning
    )
    if worker_class is None:
        return LocalGroup(config.scaling.use_gpu)
    return LocalGroup(config.scaling.use_gpu, lambda wid, gpu: worker_class(wid, gpu, in_ray=False))


def local_config(config: Config) -> Config:
    """The run's config as `--local` runs it: one worker, no spares, and no in-memory snapshots (they
    are for surviving ranks; one process has none). config.yaml keeps what was given."""
    local = copy.deepcopy(config)
    local.scaling.min_workers = local.scaling.max_workers = 1
    local.scaling.spare_workers = 0
    local.scaling.tensor_parallel = 1  # one rank holds every layer whole
    local.scaling.pipeline_parallel = 1
    local.checkpoint.memory_every_steps = 0
    return local


def take_over(run_dir: RunDir, reporter: Reporter) -> None:
    """Record this process as the run's driver; remove what a killed earlier driver left on this host."""
    from elastictrain.rundir.liveness import remove_dead_buffers, this_driver

    run_dir.set_extra("driver", this_driver())
    removed = remove_dead_buffers(run_dir.read_events())
    if removed:
        run_dir.append_event("shm_buffers_removed", paths=removed)
        reporter.event(f"removed {len(removed)} /dev/shm buffer(s) a killed worker group of this run left")


def check_before_start(config: Config) -> None:
    """Fail now, naming the config field, if the run's user code cannot work (before any worker starts).

    Also puts the folders of user modules on PYTHONPATH, so workers started from here import them.
    """
    from elastictrain.compat import refuse_unsupported_versions
    from elastictrain.compat.deepspeed.ops import prefer_environment_tools
    from elastictrain.driver.preflight import check_user_code
    from elastictrain.user_code import share_module_roots

    refuse_unsupported_versions()  # a patch correctness depends on, on an untested release: not started
    prefer_environment_tools()  # a --local run loads DeepSpeed's ops in this process
    if not config.scaling.use_gpu:
        # Before anything imports deepspeed here (a --local run trains in this process).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    check_user_code(config)
    from elastictrain.config.deepspeed_config import owned_settings_notice

    notice = owned_settings_notice(config)
    if notice:
        log.warning(notice)
    added = share_module_roots(config)
    if added:
        log.info("workers import user code from %s", ", ".join(added))


def export_at_finish(config: Config, run_dir: RunDir, reporter: Reporter) -> None:
    """At the end of a LoRA run, write the adapter (peft's layout) from the last checkpoint, with the
    run's tokenizer beside it; model.lora.export_dir may be the run folder (the adapter at its top)."""
    if not config.model.lora.enabled:
        return
    from elastictrain.checkpoint.store import CheckpointStore
    from elastictrain.tools.adapter import export_adapter

    last = CheckpointStore(run_dir.checkpoints_dir).latest_committed()
    if last is None:
        return
    out = Path(config.model.lora.export_dir)
    written = export_adapter(config, last.path, out)
    step, files = last.manifest["step"], written.files
    run_dir.append_event("adapter_exported", step=step, path=str(out), checkpoint=last.tag, files=files)
    for note in written.notes:
        reporter.event(f"note: {note}")
    tokenizer = f" with its tokenizer ({written.tokenizer.ran_with})" if written.tokenizer else ""
    reporter.event(
        f"LoRA adapter of {last.tag} exported to {out}{tokenizer} (load with peft.PeftModel.from_pretrained)"
    )


def _end_tracking(
    config: Config,
    run_dir: RunDir,
    tracker: Tracker,
    system: SystemMetrics | None,
    status: str,
    reporter: Reporter | None,
) -> None:
    """Stop system metrics, send the rest to MLflow, then (unless interrupted) plot the run from it."""
    if system is not None:
        system.stop()
    tracker.finish(status)
    tracker.close()
    if reporter is None or system is None:  # interrupted, or not tracked
        return
    left = int(getattr(tracker, "spooled", 0))
    if left and config.tracking.plots:  # MLflow is not answering: plotting from it would wait on it too
        reporter.event(
            f"plots not made: MLflow has not taken {left} spooled record(s); run `elastictrain sync "
            f"{run_dir.path}`, then `elastictrain plot {run_dir.path}`"
        )
        return
    from elastictrain.tools.plots import plots_at_end

    plots_at_end(config, run_dir, reporter.event)
