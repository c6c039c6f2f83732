"""One worker in this process, without Ray: `elastictrain train --local` and `elastictrain.fit(local=True)`.

The same TrainWorker as a Ray run (same model, data order, loss, ZeRO-3 engine, checkpoint fragments
and run folder) at world size 1, on a gloo process group over a free loopback port. A breakpoint in
your model, dataset or loss stops right there in a plain debugger, and an exception in a step reaches
you with its frames. Scaling out is a config change: a run folder written here resumes on Ray at any
world size, and the reverse, since checkpoints do not depend on the world size.

Built from the Ray loop's parts: the run recorder (events, run.json, MLflow), the choice of the
checkpoint to resume from, and the manifest. Nothing on this path imports Ray; a test runs it with
Ray made unimportable.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from elastictrain.checkpoint.model_record import configured_model
from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.control.callbacks import Callbacks
from elastictrain.control.errors import RunFailed
from elastictrain.control.evaluation import Evaluations, best_checkpoint
from elastictrain.control.manifest import manifest_fields
from elastictrain.control.record import RunRecorder
from elastictrain.control.resume import ResumePoints
from elastictrain.control.stop import sigterm_stops
from elastictrain.core.batch import BatchPlan
from elastictrain.core.losses import step_loss
from elastictrain.core.state import RunStatus
from elastictrain.progress import Reporter
from elastictrain.rundir.run_dir import RunDir
from elastictrain.storage.durable import remove_stale_temporaries
from elastictrain.tracking.tracker import Tracker


@dataclass
class LocalSummary:
    """What a local run ended as (the fields the CLI reads from the controller's RunSummary)."""

    status: RunStatus
    step: int
    message: str = ""
    world_sizes: list[int] = field(default_factory=lambda: [1])
    failures: int = 0


class LocalRun:
    """The controller's loop for one in-process worker: steps, committed checkpoints, run folder, MLflow."""

    world_size = 1

    def __init__(
        self,
        config: Any,
        run_dir: RunDir,
        tracker: Tracker,
        reporter: Reporter,
        callbacks: Callbacks | None = None,
    ) -> None:
        self.cfg = config
        self.callbacks = callbacks or Callbacks()
        self.store = CheckpointStore(run_dir.checkpoints_dir)
        self.recorder = RunRecorder(run_dir, tracker, reporter)
        self.resume = ResumePoints(self.store, configured_model(config), self.recorder)
        self.step = 0
        self.step_results: list[dict[str, Any]] = []  # for callers that inspect a run (tests, notebooks)

    def event(self, name: str, message: str = "", style: str = "", **fields: Any) -> None:
        self.recorder.event(name, message, style, step=self.step, **fields)

    def run(self) -> LocalSummary:
        with sigterm_stops():  # SIGTERM stops the run as Ctrl-C does
            return self._run()

    def _run(self) -> LocalSummary:
        from elastictrain.control.specs import single_rank_spec
        from elastictrain.worker.actor import TrainWorker

        cfg, recorder = self.cfg, self.recorder
        # Ray workers' output is not shown; here, DeepSpeed's per-micro-step deprecation notice would be.
        warnings.filterwarnings(
            "ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning
        )
        self.store.clean_partials()
        remove_stale_temporaries(recorder.run_dir.path)  # a crashed driver's `.run.json.tmp-PID`
        try:
            resume = self.resume.find(self.step)
        except RunFailed as e:  # a checkpoint of another model
            raise ValueError(str(e)) from None
        self.step = resume.manifest["step"] if resume else 0
        if resume:
            self.event("resume", f"resuming from checkpoint {resume.tag} (step {self.step})", tag=resume.tag)
        else:
            name = recorder.run_dir.read_info().name
            self.event("start", f"starting run {name} at step 0 (local, 1 worker)")
        worker = TrainWorker("local", cfg.scaling.use_gpu)
        checkpoint_dir = str(resume.path) if resume else None
        spec = single_rank_spec(cfg, checkpoint_dir=checkpoint_dir, start_step=self.step)
        plan = spec.plan
        recorder.reporter.start(self.step)
        recorder.begin(step=self.step, nothing_to_train=self.step >= cfg.training.max_steps)
        try:
            timings = worker.setup(spec)
            recorder.record_world_size(self.step, 1, "start")
            recorder.set_status(RunStatus.RUNNING, step=self.step)
            self.event(
                "attempt_started",
                f"local worker: micro batch {plan.micro_batch_size} x accumulation {plan.grad_accum_steps} "
                f"= {plan.global_batch_size}, step {self.step}, set up in {timings['total_s']:.2f}s",
                attempt=1,
                world_size=1,
                checkpoint=resume.tag if resume else None,
            )
            recorder.metrics({"world_size": 1.0}, step=self.step)
            for callback in self.callbacks.after_attempt_start:
                callback(self)
            every = cfg.checkpoint.every_steps
            evals = Evaluations(cfg, recorder)
            while self.step < cfg.training.max_steps:
                t0 = time.perf_counter()
                # The step itself, not train_step's wrapper: an error keeps its frames for the debugger.
                result = worker._train_step(self.step)
                self._report(result, time.perf_counter() - t0)
                if evals.due(result["step"]):
                    evals.record(self.step, [worker.evaluate(result["step"])])
                if self.step % every == 0 or self.step == cfg.training.max_steps:
                    self._checkpoint(worker, plan)
            recorder.set_status(RunStatus.FINISHED, "finished", step=self.step)
            self.event("finish", f"finished at step {self.step}", style="green")
            return LocalSummary(RunStatus.FINISHED, self.step, "finished")
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (control/stop.py)
            reason = str(e) or "interrupted"
            recorder.record_end(RunStatus.STOPPED, reason, step=self.step)
            self.event(
                "stop",
                f"{reason}; resume with `elastictrain resume --local {recorder.run_dir.path}`",
                style="yellow",
            )
            raise
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            recorder.record_end(RunStatus.FAILED, message, step=self.step)
            self.event("fail", f"run failed: {message}", style="bold red", reason=message)
            raise
        finally:
            worker.teardown()
            recorder.reporter.close()

    def _report(self, result: dict[str, Any], seconds: float) -> None:
        self.step = result["step"] + 1
        self.step_results.append(result)
        gbs = self.cfg.training.global_batch_size
        metrics = {
            "loss": step_loss([result]),
            "lr": float(result["lr"]),
            "step_time_s": seconds,
            "samples_per_s": gbs / seconds if seconds > 0 else 0.0,
            "tokens_per_s": gbs * self.cfg.data.seq_len / seconds if seconds > 0 else 0.0,
            "world_size": 1.0,
        }
        self.recorder.step_metrics(self.step, metrics, log_every=self.cfg.training.log_every_steps)
        for callback in self.callbacks.after_step:
            callback(self, result["step"], [result])

    def _checkpoint(self, worker: Any, plan: BatchPlan) -> None:
        """The same commit as a Ray run's (manifest fields included), with one rank's file."""
        t0 = time.perf_counter()
        staging = self.store.begin(self.step)
        report = worker.save_shard(str(staging))
        fields = manifest_fields(
            self.cfg,
            world_size=1,
            plan=plan,
            samples=self.step * self.cfg.training.global_batch_size,
            engine_state=report["engine_state"],
            info=self.recorder.run_dir.read_info(),
            built=report.get("model"),
        )
        committed = self.store.commit(self.step, staging, [report["file"]], fields)
        best = best_checkpoint(self.cfg, self.recorder)
        removed = self.store.prune(self.cfg.checkpoint.keep_last, protect=(committed.tag, *best))
        seconds = time.perf_counter() - t0
        self.recorder.metrics({"checkpoint_time_s": seconds}, step=self.step)
        self.event(
            "checkpoint",
            f"checkpoint {committed.tag} committed in {seconds:.2f}s",
            tag=committed.tag,
            seconds=seconds,
            removed=removed,
        )


def run_local(
    config: Any, run_dir: RunDir, tracker: Tracker, reporter: Reporter, callbacks: Callbacks | None = None
) -> LocalSummary:
    return LocalRun(config, run_dir, tracker, reporter, callbacks).run()
