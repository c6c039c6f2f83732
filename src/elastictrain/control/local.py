"""One worker in this process, without Ray: `elastictrain train --local` and `elastictrain.fit(local=True)`.

The same TrainWorker as a Ray run (same model, data order, loss, ZeRO-3 engine, checkpoint fragments
and run folder) at world size 1, on a gloo process group over a free loopback port. A breakpoint in
your model, dataset or loss stops right there in a plain debugger, and an exception in a step reaches
you with its frames. Scaling out is a config change: a run folder written here resumes on Ray at any
world size, and the reverse, since checkpoints do not depend on the world size.

Nothing on this path imports Ray; a test runs it with Ray made unimportable.
"""

from __future__ import annotations

import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from elastictrain.core.state import RunStatus
from elastictrain.progress import Reporter
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.tracker import Tracker


@dataclass
class LocalSummary:
    """What a local run ended as (the fields the CLI reads from the controller's RunSummary)."""

    status: RunStatus
    step: int
    message: str = ""
    world_sizes: list[int] = field(default_factory=lambda: [1])
    failures: int = 0


def loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRun:
    """The controller's loop for one in-process worker: steps, committed checkpoints, run folder, MLflow."""

    def __init__(self, config: Any, run_dir: RunDir, tracker: Tracker, reporter: Reporter) -> None:
        from elastictrain.checkpoint.store import CheckpointStore

        self.cfg = config
        self.run_dir = run_dir
        self.tracker = tracker
        self.reporter = reporter
        self.store = CheckpointStore(run_dir.checkpoints_dir)
        self.step = 0
        self.step_results: list[dict[str, Any]] = []  # for callers that inspect a run (tests, notebooks)

    def event(self, name: str, message: str = "", style: str = "", **fields: Any) -> None:
        record = self.run_dir.append_event(name, step=self.step, message=message, **fields)
        self.tracker.log_event(record)
        if message:
            self.reporter.event(message, style)

    def run(self) -> LocalSummary:
        from elastictrain.config.deepspeed_config import build_deepspeed_config
        from elastictrain.core.batch import plan_batch
        from elastictrain.worker.actor import TrainWorker
        from elastictrain.worker.attempt import AttemptSpec

        cfg = self.cfg
        # Ray workers' output is not shown; here, DeepSpeed's per-micro-step deprecation notice would be.
        warnings.filterwarnings(
            "ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning
        )
        self.store.clean_partials()
        resume = self._resume_point()
        self.step = resume.manifest["step"] if resume else 0
        if resume:
            self.event("resume", f"resuming from checkpoint {resume.tag} (step {self.step})", tag=resume.tag)
        else:
            self.event("start", f"starting run {self.run_dir.read_info().name} at step 0 (local, 1 worker)")
        plan = plan_batch(cfg.training.global_batch_size, cfg.training.micro_batch_size, 1)
        assert plan is not None  # any global batch splits at world size 1
        worker = TrainWorker("local", cfg.scaling.use_gpu)
        spec = AttemptSpec(
            attempt=1,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=loopback_port(),
            backend="nccl" if cfg.scaling.use_gpu else "gloo",
            plan=plan,
            config=cfg,
            ds_config=build_deepspeed_config(cfg, plan.micro_batch_size, plan.grad_accum_steps, 1),
            checkpoint_dir=str(resume.path) if resume else None,
            start_step=self.step,
        )
        self.reporter.start(self.step)
        self.run_dir.update(status=RunStatus.STARTING.value, last_step=self.step)
        try:
            timings = worker.setup(spec)
            self.run_dir.record_world_size(self.step, 1, "start")
            self.run_dir.update(status=RunStatus.RUNNING.value, message=None)
            self.event(
                "attempt_started",
                f"local worker: micro batch {plan.micro_batch_size} x accumulation {plan.grad_accum_steps} "
                f"= {plan.global_batch_size}, step {self.step}, set up in {timings['total_s']:.2f}s",
                attempt=1,
                world_size=1,
                checkpoint=resume.tag if resume else None,
            )
            self.tracker.log_metrics({"world_size": 1.0}, step=self.step)
            every = cfg.checkpoint.every_steps
            while self.step < cfg.training.max_steps:
                t0 = time.perf_counter()
                # The step itself, not train_step's wrapper: an error keeps its frames for the debugger.
                result = worker._train_step(self.step)
                self._report(result, time.perf_counter() - t0)
                if self.step % every == 0 or self.step == cfg.training.max_steps:
                    self._checkpoint(worker, plan)
            self.run_dir.update(status=RunStatus.FINISHED.value, message="finished", last_step=self.step)
            self.event("finish", f"finished at step {self.step}", style="green")
            return LocalSummary(RunStatus.FINISHED, self.step, "finished")
        except KeyboardInterrupt:
            self.run_dir.update(status=RunStatus.STOPPED.value, message="interrupted", last_step=self.step)
            self.event("stop", "interrupted; resume with `elastictrain resume --local`", style="yellow")
            raise
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            self.run_dir.update(status=RunStatus.FAILED.value, message=message, last_step=self.step)
            self.event("fail", f"run failed: {message}", style="bold red", reason=message)
            raise
        finally:
            worker.teardown()
            self.reporter.close()

    def _resume_point(self) -> Any:
        from elastictrain.checkpoint.store import model_mismatch, verify

        rejected: list[str] = []
        while True:
            found = self.store.latest_committed(rejected=tuple(rejected))
            if found is None:
                return None
            mismatch = model_mismatch(found.manifest, dict(self.cfg.model.hf_config))
            if mismatch:
                what = "; ".join(mismatch)
                raise ValueError(f"checkpoint {found.path} was saved from another model: {what}")
            result = verify(found.path)
            if result.ok:
                return found
            rejected.append(found.tag)
            self.event(
                "checkpoint_rejected",
                f"checkpoint {found.tag} does not verify: {'; '.join(result.problems)}",
                style="bold red",
                tag=found.tag,
            )

    def _report(self, result: dict[str, Any], seconds: float) -> None:
        self.step = result["step"] + 1
        self.step_results.append(result)
        gbs = self.cfg.training.global_batch_size
        metrics = {
            "loss": float(result["loss"]),
            "lr": float(result["lr"]),
            "step_time_s": seconds,
            "samples_per_s": gbs / seconds if seconds > 0 else 0.0,
            "tokens_per_s": gbs * self.cfg.data.seq_len / seconds if seconds > 0 else 0.0,
            "world_size": 1.0,
        }
        self.tracker.log_metrics(metrics, step=self.step)
        self.reporter.step(self.step, metrics, log_line=self.step % self.cfg.training.log_every_steps == 0)
        self.run_dir.update(last_step=self.step, last_metrics={k: round(v, 6) for k, v in metrics.items()})

    def _checkpoint(self, worker: Any, plan: Any) -> None:
        """The same commit as a Ray run's (manifest fields included), with one rank's file."""
        t0 = time.perf_counter()
        staging = self.store.begin(self.step)
        report = worker.save_shard(str(staging))
        samples = self.step * self.cfg.training.global_batch_size
        info = self.run_dir.read_info()
        committed = self.store.commit(
            self.step,
            staging,
            [report["file"]],
            {
                "world_size": 1,
                "samples_consumed": samples,
                "data_position": {"samples_consumed": samples, "seed": self.cfg.training.seed},
                "rng": {
                    "scheme": "torch reseeded per micro-batch from (training.seed, data position)",
                    "seed": self.cfg.training.seed,
                },
                "global_batch_size": self.cfg.training.global_batch_size,
                "plan": {
                    "micro_batch_size": plan.micro_batch_size,
                    "grad_accum_steps": plan.grad_accum_steps,
                },
                "engine_state": report["engine_state"],
                "model": {"hf_config": dict(self.cfg.model.hf_config)},
                "run_id": info.run_id,
                "config_digest": info.config_digest,
            },
        )
        removed = self.store.prune(self.cfg.checkpoint.keep_last, protect=(committed.tag,))
        seconds = time.perf_counter() - t0
        self.tracker.log_metrics({"checkpoint_time_s": seconds}, step=self.step)
        self.event(
            "checkpoint",
            f"checkpoint {committed.tag} committed in {seconds:.2f}s",
            tag=committed.tag,
            seconds=seconds,
            removed=removed,
        )


def run_local(config: Any, run_dir: RunDir, tracker: Tracker, reporter: Reporter) -> LocalSummary:
    return LocalRun(config, run_dir, tracker, reporter).run()
