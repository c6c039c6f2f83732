"""Telling a live driver from a dead one, and which /dev/shm buffers a dead group left (real processes)."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elastictrain.rundir.liveness import dead_rendezvous, driver_state, remove_dead_buffers, this_driver


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_this_process_is_alive_and_an_exited_one_is_not():
    me = driver_state(this_driver(), "RUNNING")
    assert me is not None and me.alive is True and "alive" in me.text

    gone = {**this_driver(), "pid": _dead_pid()}
    state = driver_state(gone, "RECOVERING", "/runs/x")
    assert state is not None and state.alive is False
    assert "NOT RUNNING" in state.text and "elastictrain resume /runs/x" in state.text


def test_a_reused_pid_is_not_taken_for_the_driver():
    record = {**this_driver(), "process_started": this_driver()["process_started"] - 3600}
    state = driver_state(record, "RUNNING")
    assert state is not None and state.alive is False


def test_other_hosts_and_ended_runs_and_missing_records():
    elsewhere = {**this_driver(), "host": "another-host-" + uuid.uuid4().hex[:6]}
    state = driver_state(elsewhere, "RUNNING")
    assert state is not None and state.alive is None and "cannot check" in state.text
    ended = driver_state({**this_driver(), "pid": _dead_pid()}, "FINISHED")
    assert ended is not None and "NOT RUNNING" not in ended.text and "FINISHED" in ended.text
    assert driver_state(None, "RUNNING") is None and driver_state({"host": "h"}, "RUNNING") is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _event(addr: str, port: int) -> dict:
    return {"event": "attempt_started", "master": f"{addr}:{port}"}


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_only_buffers_of_the_runs_dead_rendezvous_are_removed():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    live_port, dead_port, other_port = listening.getsockname()[1], _free_port(), _free_port()
    tag = uuid.uuid4().hex[:8]

    def buffer(port: int) -> Path:
        # DeepSpeed's name: deepspeed_allreduce_buffer_<n>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
        p = Path(f"/dev/shm/deepspeed_allreduce_buffer_{tag}_127.0.0.1_{port}_0")
        p.write_bytes(b"x")
        return p

    dead, live, other = buffer(dead_port), buffer(live_port), buffer(other_port)
    try:
        events = [
            {"event": "start"},
            _event("127.0.0.1", dead_port),
            _event("127.0.0.1", live_port),  # a port someone listens on again: not ours to clean
            _event("203.0.113.7", dead_port),  # another host's rendezvous: nothing of it is here
        ]
        assert dead_rendezvous(events) == [("127.0.0.1", dead_port)]
        assert remove_dead_buffers(events) == [str(dead)]
        assert not dead.exists() and live.exists() and other.exists()  # other: not this run's
    finally:
        listening.close()
        for p in (dead, live, other):
            p.unlink(missing_ok=True)
