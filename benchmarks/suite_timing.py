"""How long the test suite takes: runs a test target of the Makefile, writes benchmarks/results/suite-timing.*

`python -m benchmarks.suite_timing test` (`make suite-timing SUITE=test`) runs `make test` with a JUnit XML
report, then writes `suite-timing.json` (the latest run of each target, and every whole-suite run so far)
and `suite-timing.md`: wall and CPU time, the tests' outcomes, seconds per tier (tests/unit,
tests/integration), the slowest files and the 25 slowest tests, where the CPU went by kind of process
(benchmarks/process_cpu.py), the date, the commit and the machine. A test's seconds are pytest's
(setup, call and teardown: a module's shared setup counts where it first ran). `--render` writes the
markdown again from the JSON without running anything. The markdown's history, below its marker, is
kept as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, machine
from benchmarks.process_cpu import ProcessCpu

TARGETS = ("test", "test-unit", "test-bench", "test-compat")
HISTORY = "<!-- history: kept by hand; python -m benchmarks.suite_timing rewrites only what is above -->"
SLOWEST_TESTS = 25
SLOWEST_FILES = 15
WHOLE_SUITE_KEYS = (
    "date",
    "commit",
    "working_tree_changed",
    "machine",
    "returncode",
    "wall_s",
    "cpu_s",
    "counts",
)


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _git(*args: str) -> str:
    found = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return found.stdout.strip()


def read_junit(path: Path) -> list[dict[str, Any]]:
    """Each test case of a pytest JUnit report (junit_family=xunit1: it names the file)."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        outcome = "passed"
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(child) is not None:
                outcome = name
                break
        cases.append(
            {
                "test": f"{file}::{case.get('name')}",
                "file": file,
                "seconds": float(case.get("time") or 0.0),
                "outcome": outcome,
            }
        )
    return cases


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Outcomes, seconds per tier and per file, the slowest tests."""
    counts: dict[str, int] = defaultdict(int)
    tiers: dict[str, dict[str, float]] = defaultdict(lambda: {"tests": 0, "seconds": 0.0})
    files: dict[str, dict[str, float]] = defaultdict(lambda: {"tests": 0, "seconds": 0.0})
    for case in cases:
        counts[case["outcome"]] += 1
        parts = Path(case["file"]).parts
        tier = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        for bucket in (tiers[tier], files[case["file"]]):
            bucket["tests"] += 1
            bucket["seconds"] += case["seconds"]
    slowest = sorted(cases, key=lambda c: -c["seconds"])[:SLOWEST_TESTS]
    by_file = sorted(files.items(), key=lambda kv: -kv[1]["seconds"])[:SLOWEST_FILES]
    return {
        "counts": dict(counts),
        "test_time_s": round(sum(c["seconds"] for c in cases), 1),
        "tiers": {
            k: {"tests": v["tests"], "seconds": round(v["seconds"], 1)} for k, v in sorted(tiers.items())
        },
        "slowest_files": [
            {"file": f, "tests": v["tests"], "seconds": round(v["seconds"], 1)} for f, v in by_file
        ],
        "slowest_tests": [
            {"test": c["test"], "seconds": round(c["seconds"], 2), "outcome": c["outcome"]} for c in slowest
        ],
    }


def run_target(target: str) -> dict[str, Any]:
    """`make TARGET` with a JUnit report; its wall time, its processes' CPU time and the report read."""
    with tempfile.TemporaryDirectory() as scratch:
        xml = Path(scratch) / "junit.xml"
        pytest_args = f"--junitxml={xml} -o junit_family=xunit1 {os.environ.get('PYTEST_ARGS', '')}".strip()
        command = ["make", target, f"PYTEST_ARGS={pytest_args}"]
        cpu_before, start = _children_cpu_s(), time.monotonic()
        with ProcessCpu() as by_process:
            returncode = subprocess.run(command, cwd=ROOT, check=False).returncode
        wall, cpu = time.monotonic() - start, _children_cpu_s() - cpu_before
        cases = read_junit(xml) if xml.exists() else []
        keep = os.environ.get("SUITE_TIMING_JUNIT")  # every case's time, for comparisons of test subsets
        if keep and xml.exists():
            shutil.copyfile(xml, keep)
    return {
        "target": target,
        "command": shlex.join(command[:2] + ["PYTEST_ARGS=--junitxml=FILE -o junit_family=xunit1"]),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "working_tree_changed": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "returncode": returncode,
        "wall_s": round(wall, 1),
        # Only processes their parents waited for count (Ray's daemons, for one, are missed): a floor.
        "cpu_s": round(cpu, 1),
        "cpu_by_process": by_process.table(),
        **summarize(cases),
    }


def _counts(run: dict[str, Any]) -> str:
    order = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{run['counts'][k]} {k}" for k in order if run["counts"].get(k))


def _cell(text: str) -> str:
    """Text for a markdown table's cell (a test id may hold a newline or a pipe)."""
    return text.replace("\n", "\\n").replace("|", "\\|")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min ({seconds:.0f} s)"


def _cpu_by_process(run: dict[str, Any]) -> list[str]:
    found = run.get("cpu_by_process")
    if not found or not found["kinds"]:
        return []
    return [
        "",
        f"Where the CPU went, by kind of process ({found['total_s']:.0f} CPU s sampled from /proc each",
        "second, a floor; a Ray worker counts under the method it runs, its imports under `warmup`):",
        "",
        "| Process | Processes | CPU s |",
        "|---|---|---|",
        *(f"| {_cell(k['kind'])} | {k['processes']} | {k['cpu_s']:.1f} |" for k in found["kinds"]),
    ]


def render(data: dict[str, Any]) -> str:
    """The generated part of suite-timing.md."""
    lines = [
        "# How long the test suite takes",
        "",
        "Generated by `make suite-timing SUITE=TARGET` (`python -m benchmarks.suite_timing TARGET`) from",
        "`suite-timing.json`: the latest run of each test target of the Makefile. Seconds of a test are",
        "pytest's (setup, call and teardown; a module's shared setup counts where it first ran); CPU s are",
        "those of the processes their parents waited for, a floor (Ray's daemons are missed). The machine's",
        "speed varies by about 10% from run to run: compare a change with the code before it, back to back.",
    ]
    missing = [t for t in TARGETS if t not in data["runs"]]
    if missing:
        shown = ", ".join(f"`make {t}`" for t in missing)
        lines += ["", f"Not measured with this script yet: {shown} (`make suite-timing SUITE=test`, ...)."]
    for target in TARGETS:
        run = data["runs"].get(target)
        if run is None:
            continue
        m = run["machine"]
        changed = " (with uncommitted changes)" if run["working_tree_changed"] else ""
        lines += [
            "",
            f"## `make {target}`",
            "",
            f"- When: {run['date']}, commit `{run['commit']}`{changed}",
            f"- Machine: {m['cpus']} cores ({m['cpu_model']}), {(m['memory_bytes'] or 0) / 2**30:.0f} GiB, "
            f"load average {m['load_average_at_start'][0]:.2f} at the start",
            f"- Wall time: {_minutes(run['wall_s'])}; CPU: {run['cpu_s']:.0f} s; "
            f"tests' own time: {run['test_time_s']:.0f} s",
            f"- Result: {_counts(run)}" + ("" if run["returncode"] == 0 else f" (exit {run['returncode']})"),
            "",
            "| Tier | Tests | s |",
            "|---|---|---|",
            *(f"| `{tier}` | {t['tests']} | {t['seconds']:.1f} |" for tier, t in run["tiers"].items()),
            "",
            f"The slowest files (at most {SLOWEST_FILES}):",
            "",
            "| File | Tests | s |",
            "|---|---|---|",
            *(f"| `{f['file']}` | {f['tests']} | {f['seconds']:.1f} |" for f in run["slowest_files"]),
            "",
            f"The slowest tests (at most {SLOWEST_TESTS}):",
            "",
            "| Test | s |",
            "|---|---|",
            *(
                f"| `{_cell(t['test'])}`{'' if t['outcome'] == 'passed' else ' (' + t['outcome'] + ')'} "
                f"| {t['seconds']:.2f} |"
                for t in run["slowest_tests"]
            ),
            *_cpu_by_process(run),
        ]
    if data["whole_suite"]:
        lines += [
            "",
            "## Every `make test` this script measured",
            "",
            "| When | Commit | Cores | Wall time | CPU s | Result |",
            "|---|---|---|---|---|---|",
            *(
                f"| {r['date']} | `{r['commit']}`{'+' if r['working_tree_changed'] else ''} "
                f"| {r['machine']['cpus']} | {_minutes(r['wall_s'])} | {r['cpu_s']:.0f} | {_counts(r)} |"
                for r in data["whole_suite"]
            ),
        ]
    return "\n".join(lines) + "\n"


def write(data: dict[str, Any], results: Path) -> Path:
    (results / "suite-timing.json").write_text(json.dumps(data, indent=1) + "\n")
    page = results / "suite-timing.md"
    old = page.read_text() if page.exists() else ""
    history = old[old.index(HISTORY) :] if HISTORY in old else HISTORY + "\n"
    page.write_text(render(data) + "\n" + history)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", default="test-unit", choices=TARGETS, help="the make target")
    parser.add_argument("--render", action="store_true", help="write the markdown from the JSON only")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    stored = args.results / "suite-timing.json"
    data = json.loads(stored.read_text()) if stored.exists() else {"runs": {}, "whole_suite": []}
    returncode = 0
    if not args.render:
        run = run_target(args.target)
        returncode = run["returncode"]
        data["runs"][args.target] = run
        if args.target == "test":
            data["whole_suite"].append({k: run[k] for k in WHOLE_SUITE_KEYS})
    print(f"wrote {write(data, args.results)}")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
