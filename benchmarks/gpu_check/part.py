"""One part of the GPU check, run in a process of its own: `python -m benchmarks.gpu_check.part NAME ...`.

A part records its figures as it goes (`ctx.record`): the result file is rewritten after each, so a part
stopped at its time limit still leaves what it measured. A part returns normally when it ran, whatever
it found (a target missed is a figure, not an error), and raises when it could not measure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.profile import PROFILES, Profile


@dataclass
class PartContext:
    profile: Profile
    work: Path  # a scratch folder of this part's own
    out: Path  # the folder whose files come back from the GPU machine
    result_file: Path
    figures: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)

    def record(self, key: str, value: Any) -> None:
        self.figures[key] = value
        self._write()
        print(f"[{self.profile.name}] {key}: {_short(value)}", flush=True)

    def target(self, name: str, value: float | None, target: float, direction: str, note: str = "") -> None:
        """A figure against its target, as benchmarks/results/*.json state them."""
        met = None
        if value is not None and value == value:
            met = value >= target if direction == ">=" else value <= target
        self.targets.append(
            {"name": name, "value": value, "target": target, "direction": direction, "met": met, "note": note}
        )
        self._write()
        print(f"[{self.profile.name}] target {name}: {value} {direction} {target}: {met}", flush=True)

    def _write(self) -> None:
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"figures": self.figures, "targets": self.targets}, indent=1, default=str))
        tmp.replace(self.result_file)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) < 300 else text[:300] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--profile", required=True, choices=sorted(PROFILES))
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--result", required=True, type=Path)
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    # Before DeepSpeed is imported anywhere: the CPU accelerator only where there is no GPU.
    os.environ["DS_ACCELERATOR"] = "cuda" if profile.use_gpu else "cpu"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback
    args.work.mkdir(parents=True, exist_ok=True)
    ctx = PartContext(profile, args.work, args.out, args.result)
    ctx._write()
    # A part of the check by its name; a dotted name is any module with a run(ctx) (the runner's tests).
    module = importlib.import_module(args.name if "." in args.name else f"benchmarks.gpu_check.{args.name}")
    t0 = time.perf_counter()
    try:
        module.run(ctx)
    except Exception:  # noqa: BLE001 - the runner reads the traceback from the log and the result
        ctx.figures["error"] = traceback.format_exc(limit=12)[-4000:]
        ctx._write()
        traceback.print_exc()
        return 1
    finally:
        print(f"[{profile.name}] part {args.name} took {time.perf_counter() - t0:.1f}s", flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # DeepSpeed's and Ray's threads can hang an interpreter's teardown
