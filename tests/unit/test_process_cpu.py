"""benchmarks/process_cpu.py: the suite's CPU time by kind of process."""

from __future__ import annotations

import os
import subprocess
import sys

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
        ("/v/bin/python /tmp/pytest-of-me/pytest-3/t0/burn.py", "python burn.py"),  # arguments are not read
        ("/v/bin/python /v/bin/pytest -q tests/unit", "pytest"),
        ("/v/bin/python -m mlflow server --backend-store-uri sqlite:////tmp/m.db", "MLflow server"),
        ("/v/bin/python -m moto.server -H 127.0.0.1 -p 5000", "S3 server (moto)"),
    ],
)
def test_a_process_is_named_by_what_it_runs(cmdline, kind):
    assert kind_of(cmdline) == kind


def test_a_child_burning_cpu_is_counted_and_processes_from_before_are_not(tmp_path):
    # Names of their own: the suite's other processes run beside this test.
    burn = "import time\ntime.sleep({wait})\nend = time.process_time() + 0.6\n"
    burn += "while time.process_time() < end: pass\ntime.sleep(0.3)\n"  # a last sample sees it alive
    before, after = tmp_path / f"before_{os.getpid()}.py", tmp_path / f"after_{os.getpid()}.py"
    before.write_text(burn.format(wait=0.3))  # burns while the sampler runs
    after.write_text(burn.format(wait=0))
    started_before = subprocess.Popen([sys.executable, str(before)])
    try:
        with ProcessCpu(interval_s=0.1) as sampler:
            subprocess.run([sys.executable, str(after)], check=True)
            started_before.wait(timeout=30)
    finally:
        started_before.kill()
    kinds = {k["kind"]: k for k in sampler.table(top=1000)["kinds"]}
    row = kinds[f"python {after.name}"]
    assert row["processes"] == 1 and 0.4 <= row["cpu_s"] <= 1.5, row
    assert f"python {before.name}" not in kinds, kinds
