"""The worker: a long-lived host (one Ray actor per GPU or CPU slot) that runs one attempt at a time.

Its process, imports, compiled ops and host memory outlive attempts. An attempt is a rendezvous, a
process group and a DeepSpeed engine at that attempt's world size; `teardown` drops all three so the
same actor can join the next attempt in well under a second.
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from elastictrain.compat.deepspeed.cpu_info import remember_cpu_info
from elastictrain.compat.deepspeed.ops import load_op, prefer_environment_tools
from elastictrain.compat.deepspeed.process_state import reset_zero_counters
from elastictrain.compat.registry import check_all
from elastictrain.compat.torch_dist.collective_sockets import CollectiveSockets
from elastictrain.compat.torch_dist.gloo_gather import agreed_piece_bytes, piece_bytes, use_gather_in_pieces
from elastictrain.config.deepspeed_config import nvme_paths
from elastictrain.host.memory import (
    peak_resident_bytes,
    release_freed_memory,
    running_allocator,
    snapshot_budget_bytes,
)
from elastictrain.host.threads import use_threads
from elastictrain.storage import as_path
from elastictrain.worker.attempt import AttemptSpec
from elastictrain.worker.dist import (
    abort_collectives,
    destroy_process_group,
    release_engine,
    remove_shm_buffers,
    zero_stage,
)
from elastictrain.worker.ray_calls import actor_identity, local_identity
from elastictrain.worker.reference_share import ReferenceShare
from elastictrain.worker.shard_saves import ShardSaves
from elastictrain.worker.snapshots.peer import SnapshotPeer
from elastictrain.worker.snapshots.store import WorkerMemory
from elastictrain.worker.steps import StepRunner

# Frames from these files mean "waiting for the other ranks".
_COLLECTIVE_MODULES = (
    "torch/distributed/",
    "deepspeed/comm/",
    "deepspeed/runtime/zero/partitioned_param_coordinator",
    "elastictrain/compat/torch_dist/gloo_gather",
)

# The packages whose patches a worker decides before its first attempt (MLflow's is the driver's).
WORKER_PACKAGES = ("deepspeed", "torch", "transformers", "py-cpuinfo")


class TrainWorker(SnapshotPeer, ShardSaves, ReferenceShare, StepRunner):
    def __init__(self, worker_id: str, use_gpu: bool, *, in_ray: bool = True) -> None:
        prefer_environment_tools()  # the ninja that built DeepSpeed's ops, before any op loads
        remember_cpu_info()  # each op load and CPU Adam would otherwise probe the CPU again
        if not use_gpu:
            # Must be set before deepspeed is first imported in this process.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.use_gpu = use_gpu
        self.in_ray = in_ray  # False: hosted by the driver's process (`--local`, cluster/local_group.py)
        self.sockets = CollectiveSockets()  # the attempt's gloo connections, half-closed on leaving
        self._train_thread: int | None = None
        self._lock = threading.Lock()
        self._code_frozen = False  # the first warm-up's imports are frozen (gc.freeze), once
        self._start_run_state(worker_id)

    def _start_run_state(self, worker_id: str) -> None:
        """What belongs to one run: set at the actor's start, and again when a warm actor serves the
        next run of its driver (`leave_run`). Nothing of it may carry over from one run to the next."""
        self.worker_id = worker_id
        self.spec: AttemptSpec | None = None
        self.engine: Any = None
        self.dataset: Any = None  # any map-style dataset: len() and [i]
        self.eval_dataset: Any = None  # the validation set (data/eval_data.py), or None
        self.collate: Any = None  # data.collate, or the default with the dataset's pad id
        self.loss_fn: Any = None  # loss(model, batch) -> scalar tensor
        self.prompts: Any = None  # eval.prompts encoded (worker/generate.py), or None
        self._prompts_key: tuple[Any, ...] | None = None
        self.built_model: dict[str, Any] | None = None  # rank 0 reports it with each save (model_record.py)
        self._dataset_key: tuple[Any, ...] | None = None
        # Progress marks, read by `progress` from the control thread while a step runs.
        self._mark = ("idle", -1, time.time())
        self._writer: Any = None  # the last checkpoint's ShardWrite (checkpoint/writer.py)
        self._write_delay_s = 0.0  # a slow disk: testing/faulty_worker.py sets it
        self._idle_since = time.time()  # when this actor's last step or save ended
        self.memory = WorkerMemory(worker_id)  # in-memory snapshots: own, and the buddy's replicas
        self.memory.before_replica = lambda step: self._maybe_fault(step, "replica")

    # -- identity and health (answered from a separate concurrency group, even mid-step) --
    def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            **(actor_identity(self.use_gpu) if self.in_ray else local_identity(self.use_gpu)),
            "allocator": running_allocator(),
        }

    def warmup(self, config: Any, worker_id: str | None = None) -> dict[str, Any]:
        """Pay a new actor's one-time costs before it joins an attempt: imports, compiled ops, data.

        Runs while the others train, so a replacement joins the next attempt as fast as a survivor;
        at the lowest CPU priority (a thread of its own), so the ranks it shares a node with train on
        at full speed.
        `worker_id`: a warm actor a finished run left (`leave_run`) joins a new run under this name;
        only the new run's data is left to load.
        Returns this worker's identity (as `info`) with the seconds spent.
        """
        from elastictrain.host.niceness import run_at_lowest_priority

        if worker_id is not None:
            self.worker_id = self.memory.worker_id = worker_id
        t0 = time.perf_counter()
        # Nothing the imports and the data create is garbage: collecting on the way is wasted work
        # (about a fifth of the imports' CPU).
        gc.disable()
        try:
            run_at_lowest_priority(lambda: self._warm_up(config), "warmup")
        finally:
            gc.enable()
        return {**self.info(), "warmup_s": time.perf_counter() - t0}

    def _warm_up(self, config: Any) -> None:
        self._load_code(config)
        if not self._code_frozen:
            # The code lives as long as the process: frozen, it stays out of the full collections
            # DeepSpeed runs at each engine build and teardown, and of `leave_run`'s. The run's data
            # (loaded next) stays collectable.
            gc.freeze()
            self._code_frozen = True
        self._ensure_dataset(config)

    def _load_code(self, config: Any) -> None:
        import deepspeed  # noqa: F401

        check_all(WORKER_PACKAGES)  # a patch correctness depends on that cannot apply refuses here
        from elastictrain.model.build import preload_engine_code, preload_model_code

        if not self.use_gpu:
            # The CPU all-reduce op is loaded at the first init_distributed; load it now instead.
            load_op("ShareMemCommBuilder")
        preload_model_code(config)
        preload_engine_code(config)

    def progress(self) -> dict[str, Any]:
        """Where the training thread is: its last mark, and whether it waits inside a collective.

        A rank blocked in a collective is a victim of a stall elsewhere; the rank that is not is the
        culprit. Read from the live stack, so it works for any cause (a deadlock, a stuck data read).
        """
        with self._lock:
            phase, step, since = self._mark
        frame = sys._current_frames().get(self._train_thread) if self._train_thread else None
        stack = traceback.extract_stack(frame) if frame is not None else []
        in_collective = any(any(m in f.filename for m in _COLLECTIVE_MODULES) for f in stack)
        where = f"{stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else ""
        return {
            "worker_id": self.worker_id,
            "phase": phase,
            "step": step,
            "since": since,
            "now": time.time(),
            "in_collective": in_collective,
            "where": where,
        }

    def abort_collectives(self) -> int:
        """Called on the control thread after a failure: a training thread blocked in a collective
        whose peer is gone raises now, so this worker can leave the attempt and be kept."""
        return abort_collectives(self.use_gpu, self.sockets)

    def _set_mark(self, phase: str, step: int) -> None:
        with self._lock:
            self._mark = (phase, step, time.time())
            self._train_thread = threading.get_ident()

    # Fault points: nothing here; testing/faulty_worker.py fires what a test or chaos run injected.
    def _maybe_fault(self, step: int, phase: str = "start") -> None:
        pass

    def _arm_backward_fault(self, step: int) -> None:
        pass

    def free_port(self) -> int:
        """A port that is free on this node now: each attempt's rendezvous gets a fresh one."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    # -- attempt lifecycle --
    def setup(self, spec: AttemptSpec) -> dict[str, float]:
        """Join an attempt: process group on a fresh rendezvous, engine, state from a checkpoint."""
        import deepspeed
        import torch

        check_all(WORKER_PACKAGES)  # decided once per process: free after the warm-up

        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.engine is not None:
            self.teardown()
        self.spec = spec
        self._set_mark("setup", spec.start_step)
        os.environ.update(
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.master_port),
            RANK=str(spec.rank),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
        if self.use_gpu:
            torch.cuda.set_device(0)  # Ray gives each actor exactly one visible GPU
        timings["threads"] = use_threads(spec.config.scaling.cpus_per_worker)
        self.sockets.start()
        deepspeed.init_distributed(
            dist_backend=spec.backend,
            auto_mpi_discovery=False,
            timeout=timedelta(seconds=spec.config.failure.collective_timeout_s),
        )
        use_gather_in_pieces(spec.backend)  # a survivor of a killed gloo rank must not stay stuck
        timings["process_group_s"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        cfg = spec.config
        self._ensure_dataset(cfg)
        self.use_reference(spec.reference)  # a preference run's precomputed reference, once computed
        from elastictrain.model.build import loss_function, new_engine

        reset_zero_counters()
        self.engine = new_engine(spec, zero3=zero_stage(spec) == 3)
        # The build's temporaries are freed in pieces the optimizer's state, allocated whole at the
        # first step, cannot reuse: handed back to the system, they do not sit beside that state.
        release_freed_memory()
        self.loss_fn = loss_function(cfg)
        from elastictrain.checkpoint.model_record import built_model

        checkpointing = cfg.deepspeed.activation_checkpointing
        self.built_model = getattr(self.engine.module, "hf_record", None) or built_model(
            self.engine.module, activation_checkpointing=checkpointing
        )
        self.sockets.stop()
        if spec.backend == "gloo":  # pieces a connection's send buffer takes whole, the same on every rank
            use_gather_in_pieces(
                spec.backend, agreed_piece_bytes(piece_bytes(self.sockets.widen_send_buffers()))
            )
        timings["engine_s"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        if spec.memory is not None:
            self.memory.load(self.engine, spec.memory)
            timings["load_fetch_s"] = self.memory.last_fetch_s
        elif spec.checkpoint_dir is not None:
            from elastictrain.checkpoint.zero_state import load_committed

            load_committed(self.engine, as_path(spec.checkpoint_dir))
        if spec.memory is not None or spec.checkpoint_dir is not None:
            release_freed_memory()  # the loader's read buffers and new optimizer state, as above
        timings["load_s"] = time.perf_counter() - t2
        swapped = bool(nvme_paths(spec.ds_config))  # NVMe-swapped state: copied inline (snapshots/store.py)
        max_mb = cfg.checkpoint.max_host_memory_mb
        self.memory.attach(
            spec.attempt,
            spec.world_size,
            spec.rank,
            spec.snapshot_every,
            spec.buddy,
            inline=swapped,
            budget=lambda: snapshot_budget_bytes(max_mb, spec.ranks_on_node),
        )
        self.engine.global_steps = spec.start_step
        self._set_mark("ready", spec.start_step)
        timings["total_s"] = time.perf_counter() - t0
        # Whether the set-up or the steps set a rank's peak: the high-water mark once the state is loaded.
        timings["peak_rss_bytes"] = float(peak_resident_bytes() or 0)
        return timings

    def _ensure_dataset(self, cfg: Any) -> None:
        import dataclasses

        from elastictrain.data.eval_data import train_and_eval_datasets
        from elastictrain.user_code import user_callable

        key = (repr(dataclasses.asdict(cfg.data)), repr((cfg.eval.split, cfg.eval.data)), cfg.training.seed)
        if key != self._dataset_key:  # kept across attempts: part of what a warm actor saves
            self.dataset, self.eval_dataset = train_and_eval_datasets(cfg)
            self._dataset_key = key
        prompts_key = (key, repr(cfg.eval.prompts), cfg.eval.chat_template)
        if prompts_key != self._prompts_key:  # a tokenizer load: once per actor, not per attempt
            from elastictrain.worker.generate import prompt_set

            self.prompts = prompt_set(cfg, self.eval_dataset)
            self._prompts_key = prompts_key
        from elastictrain.data.sources import run_collate

        self.collate = run_collate(self.dataset, user_callable(cfg, "data.collate"))  # pad id: the dataset's

    def _abandon_attempt(self) -> None:
        """Drop the engine (freed, its memory given back before a next one is built beside it) and the
        process group."""
        # An in-memory copy of the last step may still be reading the engine: it completes first (its
        # replication may go on: a buddy on a lost node answers only once Ray notices).
        self.memory.copy_finished()
        release_engine(self.engine)
        self.engine = None
        if "transformers" in sys.modules:  # a pretrained folder loaded under ZeRO-3 told transformers so
            from elastictrain.model.build import forget_hf_deepspeed_config

            # Models built next in this process (a --local driver's own) are not ZeRO-3 ones.
            forget_hf_deepspeed_config()
        gc.collect()
        release_freed_memory()
        destroy_process_group(self.use_gpu, self.sockets)

    def teardown(self) -> dict[str, float]:
        """Leave the attempt: drop engine and process group, forget DeepSpeed's groups of the old world."""
        t0 = time.perf_counter()
        # A background write may still fill a staging folder the controller is about to drop or reuse.
        self._join_writer()
        self._writer = None
        addr_port, swap = None, []
        if self.spec is not None:
            addr_port = (self.spec.master_addr, self.spec.master_port)
            swap = nvme_paths(self.spec.ds_config)  # this rank's own (`<nvme_path>/<run_id>/rank-N`)
        self._abandon_attempt()
        if addr_port is not None:
            remove_shm_buffers(*addr_port)
        for folder in swap:  # swap files are worthless once the engine is gone; the rank may change
            shutil.rmtree(folder, ignore_errors=True)
        self.spec = None
        self._set_mark("idle", -1)
        return {"teardown_s": time.perf_counter() - t0}

    def leave_run(self) -> dict[str, float]:
        """The run is over and this actor stays warm for its driver's next run (scaling.keep_warm_s):
        leave the attempt, give back the snapshots and replicas it held, and forget the run's data,
        faults and marks. The imports, compiled ops and loaded model code are what stays."""
        t0 = time.perf_counter()
        self.teardown()
        self.memory.close()
        self._start_run_state(self.worker_id)
        gc.collect()  # the run's objects, not the frozen code
        release_freed_memory()
        return {"leave_run_s": time.perf_counter() - t0}
