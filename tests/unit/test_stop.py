"""Issue 12 points 4 and 18: Ctrl-C and SIGTERM stop a run cleanly, keeping a save whose files are in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from loop_harness import at_step, make_run

from elastictrain.checkpoint.store import verify


def _interrupt_after_collect(r: Any, at: int, finish_writes: bool) -> None:
    """Ctrl-C just after the save of step `at` is collected: its files written (or not), not reported."""
    real = r.controller.saves.collect

    def collect(save: Any, step: int) -> None:
        real(save, step)
        if step == at:
            if finish_writes:
                for w in r.group.workers:
                    w.writer.finish()  # every rank's file is on disk; the driver has not heard yet
            raise KeyboardInterrupt

    r.controller.saves.collect = collect


def test_ctrl_c_after_every_rank_file_is_written_commits_that_save(tmp_path: Path) -> None:
    r = make_run(tmp_path)
    _interrupt_after_collect(r, 8, finish_writes=True)
    with pytest.raises(KeyboardInterrupt):
        r.run()
    assert r.status == "STOPPED" and r.committed_step() == 8  # not 4: no steps lost
    assert verify(r.run_dir.checkpoints_dir / "step-000008").ok
    assert not r.events("checkpoint_abandoned")
    assert r.group.workers == []


def test_ctrl_c_while_a_rank_file_is_still_being_written_drops_that_save_and_stops(tmp_path: Path) -> None:
    r = make_run(tmp_path)
    r.controller.callbacks.after_step.append(at_step(5, lambda c: r.group.save_hangs(rank=1)))
    _interrupt_after_collect(r, 8, finish_writes=False)
    with pytest.raises(KeyboardInterrupt):
        r.run()
    assert r.status == "STOPPED" and r.committed_step() == 4
    (dropped,) = r.events("checkpoint_abandoned")
    assert dropped["step"] == 8 and dropped["written"] == 1
    stop = r.events("stop")[0]
    assert f"resume with `elastictrain resume {r.run_dir.path}`" in stop["message"]


DRIVER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from loop_harness import make_run

r = make_run(Path(sys.argv[1]), "training.max_steps=1000")

def slow(controller, step, results):
    if step == 6:
        print("stepping", flush=True)
    time.sleep(0.05)

r.controller.callbacks.after_step.append(slow)
try:
    r.run()
except KeyboardInterrupt as e:
    print("exit:", e, flush=True)
    sys.exit(143)
"""


def test_sigterm_stops_the_run_like_ctrl_c_and_records_stopped(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "stepping"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "exit: stopped by SIGTERM" in out
    assert time.monotonic() - t0 < 30
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "STOPPED" and info["message"] == "stopped by SIGTERM"
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "stopped by SIGTERM"


def test_a_sigterm_is_known_as_such_when_the_exception_it_raised_was_replaced() -> None:
    """Code the signal interrupts may catch the Stopped and raise a KeyboardInterrupt of its own: the
    loop reads what sigterm_stops saw (a suite run recorded "interrupted" for a SIGTERMed driver)."""
    from elastictrain.control.stop import sigterm_stops

    with sigterm_stops() as seen:
        assert not seen.sigterm
        try:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises in this thread before the sleep ends
            except KeyboardInterrupt:
                raise KeyboardInterrupt() from None  # as code that catches and raises its own may
        except KeyboardInterrupt as e:
            assert str(e) == "" and seen.sigterm
