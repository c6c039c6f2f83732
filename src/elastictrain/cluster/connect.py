"""The driver's connection to Ray: a cluster at an address, or a local one on loopback for this process."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from elastictrain.config import Config
from elastictrain.redact import install_log_redaction

log = logging.getLogger("elastictrain.launch")

# The Ray settings of a cluster started here. Ray starts idle workers for the first driver's tasks; the
# training actors carry environment variables of their own (worker_group), so they never take one: each
# would cost its imports for nothing. The tests' clusters start with the same.
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def connect_ray(config: Config, address: str | None) -> str:
    """Connect to the cluster at --address / ray.address / RAY_ADDRESS, or start a local one on loopback."""
    import ray

    target = address or config.ray.address or os.environ.get("RAY_ADDRESS")
    # The loop reads every reply it acts on and reports the error itself (the worker's traceback once);
    # steps queued behind a failed one fail too, and Ray would print each as pages of "Unhandled error".
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if ray.is_initialized():
        return "already connected"
    if target:
        cwd = _cwd()
        ray.init(address=target, log_to_driver=False)
        install_log_redaction()  # again: a library may have replaced the record factory
        _reenter(cwd)
        return f"connected to Ray at {target}"
    # A local cluster serves only this process: keep every Ray server on loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # address="local": a new cluster, never the one the last `ray start` on this machine recorded.
    # Its CPUs are this machine's (Ray counts them, cgroup limits included) unless ray.num_cpus says
    # otherwise: never scaling.max_workers' worth of CPUs the machine does not have.
    ray.init(
        address="local",
        num_cpus=config.ray.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _system_config=LOCAL_SYSTEM_CONFIG,
    )
    install_log_redaction()  # again: a library may have replaced the record factory
    return local_capacity_note(config, float(ray.cluster_resources().get("CPU", 0)))


def local_capacity_note(config: Config, cpus: float) -> str:
    """What a local cluster of `cpus` CPUs can run of scaling.*; the loop waits or fails for the rest."""
    s = config.scaling
    note = f"started a local Ray cluster with {cpus:g} CPUs"
    fits = int(cpus // s.cpus_per_worker)
    wanted = s.max_workers + s.spare_workers
    if fits >= wanted:
        return note
    spares = f" + scaling.spare_workers={s.spare_workers}" if s.spare_workers else ""
    return (
        f"{note}: room for {fits} worker(s) of scaling.cpus_per_worker={s.cpus_per_worker:g}, not "
        f"scaling.max_workers={s.max_workers}{spares} (set ray.num_cpus to start more workers than this "
        "machine has CPUs)"
    )


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:
        return None


def _reenter(path: str | None, watch_s: float = 60.0) -> None:
    """Keep this process in its working folder when Ray replaces that folder under it.

    In a `ray job submit` job, registering the driver makes Ray unpack the job's working_dir again at
    the same path (seen with Ray 2.60, shortly after ray.init returns): the folder the driver runs in
    is deleted, os.getcwd() raises and MLflow's local stores, which resolve paths against the cwd,
    fail. The new folder holds the same files: step into it, now and for a while in the background.
    """
    if path is None:
        return

    def step_in() -> None:
        try:
            os.getcwd()
        except FileNotFoundError:
            with contextlib.suppress(OSError):  # not unpacked again yet: the next look retries
                os.chdir(path)
                log.info("Ray unpacked the job's working folder again; continuing in the new one")

    step_in()
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") is None:
        return  # not a Ray job: nothing replaces the folder

    def watch() -> None:
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            step_in()
            time.sleep(0.1)

    threading.Thread(target=watch, name="elastictrain-cwd", daemon=True).start()
