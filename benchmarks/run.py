"""`make bench`: run the benchmarks side by side, write results/*.json, PNG plots and BENCHMARKS.md.

    python -m benchmarks.run [--only NAME[,NAME]] [--smoke] [--reps N] [--results DIR] [--markdown FILE]
                             [--sizes 30m,125m,350m,1b] [--redo] [--parts reshard,recovery,checkpoint]
    python -m benchmarks.run --report-only    # BENCHMARKS.md again from results/*.json, nothing run

Benchmarks: throughput, checkpoint_stall, memory, reshard, recovery, memory_recovery, controller_scale,
zero_stages, warm_rerun; and, only when named with --only: straggler (one rank of 3 slowed, kept or
replaced), goodput (a long run with failures injected), memory_presets (in-memory snapshots at the 30M
and 125M presets, default settings), sft (one epoch of instruction records against Hugging Face's
Trainer), dpo (one epoch of preference pairs against TRL's DPOTrainer, LoRA and full fine-tune), pipeline
(stages against ZeRO-3 and tensor parallelism at 2 ranks, 30M and 125M; a P 2 x D 2 recovery) and scale
(30M to 1B parameters: hours on 2 cores; `--sizes` picks sizes, and sizes already in results/scale.json
are skipped unless `--redo`). Runs that several benchmarks read (the plain training runs of each system)
happen once per repetition.
`--smoke` runs every benchmark at its smallest size, for the harness's own test: not a measurement.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import (
    baselines,
    checkpoint_stall,
    controller_scale,
    dpo,
    goodput,
    memory,
    memory_presets,
    memory_recovery,
    pipeline,
    recovery,
    report,
    reshard,
    scale,
    sft,
    straggler,
    throughput,
    warm_rerun,
    zero_stages,
)
from benchmarks.common import RESULTS, ROOT, workload

MODULES = {
    "throughput": throughput,
    "checkpoint_stall": checkpoint_stall,
    "memory": memory,
    "reshard": reshard,
    "recovery": recovery,
    "memory_recovery": memory_recovery,  # after recovery: it reads Ray Train's figures from that run
    "controller_scale": controller_scale,
    "zero_stages": zero_stages,
    "warm_rerun": warm_rerun,
    "goodput": goodput,
    "memory_presets": memory_presets,
    "scale": scale,
    "sft": sft,
    "dpo": dpo,
    "straggler": straggler,
    "pipeline": pipeline,
}
# Long: run with --only (GOODPUT_MINUTES sets goodput's length).
OPT_IN = {"goodput", "memory_presets", "scale", "sft", "dpo", "straggler", "pipeline"}
DEFAULT_REPS = 1  # the full run stays under 25 minutes on 2 cores; more with --reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(MODULES)}")
    parser.add_argument(
        "--smoke", action="store_true", help="smallest sizes, 1 repetition: tests the harness"
    )
    parser.add_argument(
        "--reps", type=int, default=None, help=f"repetitions (default {DEFAULT_REPS}; smoke 1)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for <benchmark>.json and plots")
    parser.add_argument("--markdown", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--sizes", default="", help=f"scale: comma-separated subset of {', '.join(scale.SIZES)}"
    )
    parser.add_argument(
        "--redo", action="store_true", help="scale: measure sizes already in scale.json again"
    )
    parser.add_argument(
        "--parts",
        default="",
        help="scale: measure these parts (reshard, recovery, checkpoint) of measured sizes again",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: write the markdown from the stored results, linking the plots already there",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        return _report_only(args.results, args.markdown)

    names = [n.strip() for n in args.only.split(",") if n.strip()] or [n for n in MODULES if n not in OPT_IN]
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {unknown}; expected any of {', '.join(MODULES)}")
    reps = args.reps if args.reps is not None else (1 if args.smoke else DEFAULT_REPS)
    if reps < 1:
        parser.error(f"--reps: got {reps}; expected an integer >= 1")
    w = workload(args.smoke)
    args.results.mkdir(parents=True, exist_ok=True)
    scratch_root = RESULTS / "tmp"  # git-ignored; big checkpoints land here, never in the results
    scratch_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-", dir=scratch_root))
    baselines.clear()
    t_all = time.time()
    try:
        for name in names:
            t0 = time.time()
            print(f"== {name} ({'smoke' if args.smoke else w.name}, {reps} rep(s))", flush=True)
            mod = MODULES[name]
            if name == "controller_scale":
                result = mod.run(reps, args.smoke)
            elif name == "scale":
                try:
                    result = scale.run(
                        w,
                        scratch,
                        reps,
                        args.smoke,
                        sizes=args.sizes,
                        redo=args.redo,
                        results=args.results,
                        parts=args.parts,
                    )
                except ValueError as e:  # --sizes or --parts naming what is not there: said, no traceback
                    parser.error(str(e))
            else:
                result = mod.run(w, scratch, reps, args.smoke)
            path = result.write(args.results)
            print(f"   wrote {path} in {time.time() - t0:.0f}s", flush=True)
    finally:
        _shutdown_ray()
        shutil.rmtree(scratch, ignore_errors=True)
    results = report.load_results(args.results, list(MODULES))
    plots: dict[str, str] = {}
    if not args.no_plots:
        for r in results:
            png = args.results / f"{r['benchmark']}.png"
            MODULES[r["benchmark"]].plot(r, png)
            plots[r["benchmark"]] = _relative(png, args.markdown.parent)
    report.write_markdown(results, args.markdown, plots)
    print(f"wrote {args.markdown}; all benchmarks took {time.time() - t_all:.0f}s", flush=True)
    return 0


def _report_only(results_dir: Path, markdown: Path) -> int:
    results = report.load_results(results_dir, list(MODULES))
    if not results:
        print(f"no results in {results_dir}: run the benchmarks first", file=sys.stderr)
        return 1
    pngs = {r["benchmark"]: results_dir / f"{r['benchmark']}.png" for r in results}
    plots = {name: _relative(png, markdown.parent) for name, png in pngs.items() if png.exists()}
    report.write_markdown(results, markdown, plots)
    print(f"wrote {markdown} from {len(results)} stored result(s)", flush=True)
    return 0


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
