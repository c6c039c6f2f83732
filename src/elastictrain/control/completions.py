"""What the model says at each validation (`eval.prompts`): recorded once per validation, from rank 0.

Every rank generates the same text in lockstep (worker/generate.py); rank 0's is logged, and whether
every rank's agreed is recorded beside it. Results go to the terminal (the first completion),
events.jsonl (`completions`: step, ranks_agree and each prompt, completion and reference), run.json
(`last_completions`, which `elastictrain status` shows) and MLflow: eval_completions.json, every
validation's rows so far, in mlflow.log_table's layout (`mlflow.load_table` reads it back).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from elastictrain.control.record import RunRecorder
from elastictrain.core.prompts import TABLE_ARTIFACT, one_line, rank_zero_completions, table, table_rows

log = logging.getLogger("elastictrain.controller")


class Completions:
    def __init__(self, config: Any, recorder: RunRecorder) -> None:
        self.recorder = recorder
        self.enabled = config.eval.prompts is not None
        # The table holds every validation's rows; after a driver restart it starts from events.jsonl.
        self.rows: list[list[Any]] = []
        if self.enabled:
            for e in recorder.run_dir.read_events():
                if e.get("event") == "completions":
                    self.rows.extend(table_rows(int(e["step"]), e.get("completions") or []))

    def record(self, step: int, results: Sequence[dict[str, Any]]) -> None:
        completions, agree = rank_zero_completions(results)
        if not self.enabled or not completions:
            return
        first = completions[0]
        more = f" (+{len(completions) - 1} more: elastictrain status)" if len(completions) > 1 else ""
        style = "cyan" if agree else "bold red"
        said = f"{one_line(first['prompt'], 40)!r} -> {one_line(first['completion'])!r}"
        message = f"model at step {step}: {said}"
        if not agree:
            message += "; the ranks generated different text (rank 0's logged)"
        self.recorder.event(
            "completions", message + more, style, step=step, ranks_agree=agree, completions=completions
        )
        try:
            self.recorder.run_dir.set_extra("last_completions", {"step": step, "completions": completions})
        except OSError as e:  # a full disk must not stop training; the event and MLflow have it
            log.warning("could not record last_completions in run.json: %s", e)
        self.rows.extend(table_rows(step, completions))
        self.recorder.tracker.log_artifact_text(json.dumps(table(self.rows)), TABLE_ARTIFACT, table=True)
