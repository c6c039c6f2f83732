"""`make gpu-check`: every part of the GPU check in order, each in its own process under its own limit.

    python -m benchmarks.gpu_check [--dry] [--out DIR] [--parts numerics,throughput] [--budget-s 515]
                                [--limit throughput=240]

After every part, `OUT/gpu-check.json` is rewritten with all that finished so far (figures, targets met
or missed, each part's status, seconds and the end of its log), so a check cut off at the machine's
limit still leaves what it measured. `OUT/gpu-check.log` holds every part's whole output. `--dry` runs
the same parts on this machine's CPU (gloo, the tiny model): a test runs it so the check cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.profile import DRY, GPU, PARTS, ROOT

LOG_LIMIT_BYTES = 12 * 2**20  # a file that comes back from the GPU machine may hold 16 MiB


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _tail(path: Path, lines: int = 40) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def run_part(
    name: str, profile_name: str, limit_s: float, work: Path, out: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one part to its end or its limit; its figures survive either way."""
    part_work = work / name
    part_work.mkdir(parents=True, exist_ok=True)
    result_file = work / f"{name}.result.json"
    log_file = work / f"{name}.log"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.part", name, "--profile", profile_name]
    cmd += ["--work", str(part_work), "--out", str(out), "--result", str(result_file)]
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log_file, "wb") as log:
        # A session of its own: at the limit the part and everything it started (Ray's processes, the
        # DeepSpeed launcher's ranks) are killed together.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=limit_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timed out"
    seconds = time.perf_counter() - t0
    try:
        result = json.loads(result_file.read_text())
    except (OSError, ValueError):
        result = {"figures": {}, "targets": []}
    return {
        "status": status,
        "seconds": round(seconds, 1),
        "limit_s": limit_s,
        **result,
        "log_tail": _tail(log_file),
    }


def _append_log(out: Path, name: str, log_file: Path) -> None:
    dest = out / "gpu-check.log"
    size = dest.stat().st_size if dest.exists() else 0
    with open(dest, "ab") as f:
        f.write(f"\n===== part {name} =====\n".encode())
        data = log_file.read_bytes() if log_file.exists() else b""
        room = max(0, LOG_LIMIT_BYTES - size)
        f.write(data[-room:] if len(data) > room else data)


class OpBuild:
    """`elastictrain build-ops` in the background from the check's start: DeepSpeed compiles CPU Adam and
    async I/O on first use (a minute or more), and the offload part needs them. Its time is stated apart."""

    def __init__(self, work: Path, use_gpu: bool, jobs: int) -> None:
        self.work = work
        self.state: dict[str, Any] = {"status": "running"}
        cmd = [sys.executable, "-m", "elastictrain", "build-ops", *(["--gpu"] if use_gpu else [])]
        env = {**os.environ, "MAX_JOBS": str(jobs), "PYTHONUNBUFFERED": "1"}
        self.log = work / "build-ops.log"
        self.t0 = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        code = self.proc.wait()
        self.state = {
            "status": "ok" if code == 0 else f"exit {code}",
            "seconds": round(time.perf_counter() - self.t0, 1),
            "report": _tail(self.log, 8),
        }
        (self.work / "build-ops.done").write_text(json.dumps(self.state))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="on this machine's CPU: gloo, the tiny model")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else benchmarks/results/tmp")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: under /tmp)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="all parts together (default: sum of limits)"
    )
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="one part's time limit instead of the profile's (repeatable)",
    )
    args = parser.parse_args(argv)
    profile = DRY if args.dry else GPU
    limits = dict(profile.limits)
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in limits or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--limit: got {item!r}; expected PART=SECONDS with PART among {','.join(PARTS)}")
        limits[name] = int(float(seconds))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: got {','.join(unknown)}; expected names among {','.join(PARTS)}")
    out = args.out or Path(
        os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "tmp" / f"gpu-check-{profile.name}"
    )
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path("/tmp") / f"elastictrain-gpu-check-{profile.name}-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.log").write_bytes(b"")
    budget = args.budget_s if args.budget_s is not None else sum(limits[p] for p in parts)
    report: dict[str, Any] = {
        "check": "gpu-check",
        "profile": profile.name,
        "started": _now(),
        "host": platform.node(),
        "python": platform.python_version(),
        "budget_s": budget,
        "parts": {},
    }
    t_start = time.perf_counter()
    ops = (
        OpBuild(work, profile.use_gpu, jobs=max(1, (os.cpu_count() or 2) // 2))
        if "offload" in parts
        else None
    )
    for name in parts:
        left = budget - (time.perf_counter() - t_start)
        limit = min(limits[name], left)
        if limit < 5:
            report["parts"][name] = {"status": "skipped", "why": f"{left:.0f}s of the budget left"}
            _write_json(out / "gpu-check.json", report)
            continue
        print(f"gpu-check [{profile.name}] part {name} (limit {limit:.0f}s)", flush=True)
        result = run_part(name, profile.name, limit, work, out)
        _append_log(out, name, work / f"{name}.log")
        report["parts"][name] = result
        report["finished"] = _now()
        if ops is not None:
            report["build_ops"] = ops.state
        _write_json(out / "gpu-check.json", report)
        missed = [t["name"] for t in result.get("targets", []) if t.get("met") is False]
        print(
            f"gpu-check [{profile.name}] part {name}: {result['status']} in {result['seconds']}s"
            + (f"; targets missed: {', '.join(missed)}" if missed else ""),
            flush=True,
        )
        if result["status"] != "ok":
            print("\n".join(result["log_tail"][-15:]), flush=True)
    if ops is not None:
        ops.stop()
    failed = [n for n, r in report["parts"].items() if r["status"] != "ok"]
    print(
        f"gpu-check [{profile.name}]: {len(parts) - len(failed)} of {len(parts)} parts ran; results in {out}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
