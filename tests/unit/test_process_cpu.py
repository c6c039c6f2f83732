"""benchmarks/process_cpu.py: the suite's CPU time by kind of process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.process_cpu import ProcessCpu, kind_of


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        ("ray::TrainWorker.warmup", "ray::TrainWorker.warmup"),
        ("ray::IDLE", "Ray worker idle"),
        (
            "/v/bin/python /v/lib/ray/_private/workers/default_worker.py --node-ip-address=1",
            "Ray worker process, before it hosts an actor",
        ),
        ("/v/lib/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "Ray raylet"),
        ("/v/bin/python -u /v/lib/ray/dashboard/agent.py --node-ip-address=1", "Ray dashboard agent"),
        ("/v/bin/python /v/bin/elastictrain train -c conf/tiny-cpu.yaml", "elastictrain CLI"),
        ("/v/bin/python -m elastictrain resume runs/x", "elastictrain CLI"),
        (
            "/v/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))",
            "pytest worker (drivers, references)",
        ),
        ("/usr/bin/python3 /tmp/something.py arg", "python something.py"),
        ("/usr/bin/gcc -O2 x.c", "gcc"),
    ],
)
def test_a_process_is_named_by_what_it_runs(cmdline, kind):
    assert kind_of(cmdline) == kind


def test_a_child_burning_cpu_is_counted_and_processes_from_before_are_not():
    with ProcessCpu(interval_s=0.1) as sampler:
        burn = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
        burn += "time.sleep(0.3)"  # a second sample sees it alive
        subprocess.run([sys.executable, "-c", burn], check=True)
        time.sleep(0.2)
    table = sampler.table()
    (row,) = [k for k in table["kinds"] if k["kind"] == "python -c"]
    assert row["processes"] == 1 and 0.4 <= row["cpu_s"] <= 1.5, table
    assert table["total_s"] < 3, table  # this process and the machine's others are not counted
