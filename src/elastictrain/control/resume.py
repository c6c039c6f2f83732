"""Which committed checkpoint a (re)start loads: the newest that verifies, never one of another model."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from elastictrain.checkpoint.model_record import model_mismatch
from elastictrain.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    Committed,
    Verification,
    verify,
)
from elastictrain.control.errors import RunFailed
from elastictrain.control.record import RunRecorder
from elastictrain.core.checkpoints import choose_resume_tag, step_of_tag


class ResumePoints:
    def __init__(self, store: CheckpointStore, configured: dict[str, Any], recorder: RunRecorder) -> None:
        self.store = store
        self.configured = configured  # the model as the config describes it (model_record.configured_model)
        self.recorder = recorder
        self.rejected: list[str] = []  # checkpoints that failed verification: never loaded again
        self.passed_over: list[str] = []  # checkpoints saved after a rollback's bad steps began
        self.last_verify_s = 0.0
        self._step = 0  # the loop's step at the last find(), for the events of latest()

    def latest(self) -> Committed | None:
        """The newest committed checkpoint not rejected (not verified again).

        One whose manifest cannot be read (corrupt JSON, EIO) is rejected like one that does not
        verify, and the previous one is used.
        """
        while True:
            tag = choose_resume_tag(self.store.listing(), (*self.rejected, *self.passed_over))
            if tag is None:
                return None
            try:
                return Committed(tag, self.store.root / tag, self.store.manifest(tag))
            except CheckpointError as e:
                self.reject(tag, [str(e)], self._step)

    def reject(self, tag: str, problems: list[str], step: int) -> None:
        self.rejected.append(tag)
        self.recorder.event(
            "checkpoint_rejected",
            f"checkpoint {tag} does not verify and will not be loaded: {'; '.join(problems)}"
            " -- falling back to the previous committed checkpoint",
            style="bold red",
            step=step,
            tag=tag,
            problems=problems,
        )

    def pass_over_after(self, step: int, why: str) -> None:
        """Pass over committed checkpoints of steps after `step` from now on (a rollback's: they were saved
        once bad steps began); a restart finding none left starts from the beginning."""
        later = [t for t in self.store.listing().committed if (step_of_tag(t) or 0) > step]
        self.passed_over.extend(t for t in later if t not in self.passed_over)
        if later:
            self.recorder.event(
                "checkpoints_passed_over",
                f"checkpoint(s) {', '.join(later)} will not be loaded: {why}",
                style="yellow",
                step=self._step,
                tags=later,
            )

    def saved_anew(self, tag: str) -> None:
        """A checkpoint of this tag was committed again: the damaged copy is gone."""
        if tag in self.rejected:
            self.rejected.remove(tag)
        if tag in self.passed_over:
            self.passed_over.remove(tag)

    def candidate(self, step: int) -> Committed | None:
        """The newest committed checkpoint not rejected, not yet verified; one of another model is refused.

        `step` is the loop's step, for the events.
        """
        self._step = step
        found = self.latest()
        if found is None:
            if self.rejected:  # never silently back to step 0 when checkpoints existed
                raise RunFailed(
                    f"no checkpoint in {self.store.root} verifies "
                    f"(rejected: {', '.join(self.rejected)}); "
                    "not starting over from step 0 on its own. Restore a checkpoint and "
                    "`elastictrain resume RUN_DIR`, or start over with `elastictrain train --fresh` "
                    "(moves this run folder aside)"
                )
            return None
        mismatch = model_mismatch(found.manifest, self.configured)
        if mismatch:
            raise RunFailed(
                f"checkpoint {found.path} was saved from another model: {'; '.join(mismatch[:5])}. "
                "Resume it with the config it was trained with (its run folder's config.yaml), "
                "or give this config a new run.dir"
            )
        return found

    def find(self, step: int) -> Committed | None:
        """The newest committed checkpoint whose every file matches its manifest's sha256.

        One that does not verify is rejected (and said so in the terminal, events.jsonl and MLflow);
        the previous one is used instead. A checkpoint of another model is refused outright.
        """
        while True:
            found = self.candidate(step)
            if found is None or self._verified(found, verify(found.path), step):
                return found

    @contextmanager
    def verified_beside(self, found: Committed | None, step: int) -> Iterator[Verdict]:
        """Verify `found` in a thread while the block sets up the workers that load it.

        The workers build their engines before they read the checkpoint, which takes longer than the
        check, so the check adds no time to a (re)start. On leaving,
        even by an exception, the check is awaited: a checkpoint that does not verify is rejected, and
        `Verdict.ok` is False: whatever loaded it must be set up again (`candidate` gives the previous).
        """
        verdict = Verdict()
        if found is None:
            yield verdict
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-checkpoint") as pool:
            checking = pool.submit(verify, found.path)
            try:
                yield verdict
            finally:
                verdict.ok = self._verified(found, checking.result(), step)

    def _verified(self, found: Committed, result: Verification, step: int) -> bool:
        self.last_verify_s = result.seconds
        if not result.ok:
            self.reject(found.tag, result.problems, step)
        return result.ok


@dataclass
class Verdict:
    """Whether the checkpoint a block loaded verified (set when the block is left)."""

    ok: bool = True
