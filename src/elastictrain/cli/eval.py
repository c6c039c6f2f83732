"""CLI commands about a run's validation: `eval` (any checkpoint), and the lines `status` shows of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from elastictrain.cli.output import choose, fail, out

_EVAL_OVERRIDES = (
    "eval.every_steps=",
    "eval.steps=",
    "eval.prompts=",
    "eval.max_new_tokens=",
    "eval.chat_template=",
)


def evaluate_command(
    run_dir: Annotated[Path, typer.Argument(help="a run folder")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="eval.* settings for this evaluation, e.g. eval.steps=4 eval.prompts=4"),
    ] = None,
    checkpoint: Annotated[
        str | None, typer.Option("--checkpoint", help="a checkpoint tag (default: the one a resume loads)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as one JSON object")] = False,
) -> None:
    """Evaluate a checkpoint on the run's validation set (in this process, one worker, no Ray)."""
    from elastictrain.checkpoint.store import verify_checkpoint
    from elastictrain.config import ConfigError, load_config
    from elastictrain.rundir.run_dir import RunDir, RunDirError
    from elastictrain.tools.evaluate import evaluate_checkpoint

    bad = [o for o in overrides or [] if not o.startswith(_EVAL_OVERRIDES)]
    if bad:
        fail(
            f"eval: got {bad[0]!r}; only eval.steps=N, eval.prompts, eval.max_new_tokens and "
            "eval.chat_template (and eval.every_steps) may change for an evaluation"
        )
    try:
        rd = RunDir.open(run_dir)
        cfg = load_config(rd.config_yaml, overrides or [])
    except (RunDirError, ConfigError) as e:
        fail(str(e))
    if checkpoint is None:
        path = choose(rd.path)
    else:
        path = rd.checkpoints_dir / checkpoint
        if not (path / "manifest.json").is_file():
            tags = sorted(
                p.name for p in rd.checkpoints_dir.glob("step-*") if (p / "manifest.json").is_file()
            )
            known = ", ".join(tags) or "none"
            fail(f"--checkpoint: got {checkpoint!r}; committed checkpoints of {run_dir}: {known}")
    problems = verify_checkpoint(path)
    if problems:
        fail(f"{path} does not verify, not evaluating it:\n" + "\n".join(problems), code=1)
    from elastictrain.driver.layout_auto import resolve_in_this_process

    resolve_in_this_process(cfg)  # a run with auto layout fields: chosen for this one process
    try:
        result = evaluate_checkpoint(cfg, path)
    except ValueError as e:
        fail(str(e))
    if as_json:
        out.print(json.dumps({"checkpoint": path.name, **result}), markup=False)
        return
    out.print(
        f"{path.name}: eval_loss {result['eval_loss']:.6f}, perplexity {result['eval_perplexity']:.4f} "
        f"({int(result['eval_tokens'])} tokens, {int(result['eval_samples'])} samples)"
    )
    if "completions" in result:
        lines = completion_lines({"step": int(result["step"]), "completions": result["completions"]})
        out.print("\n".join(lines), markup=False)


def eval_lines(extra: dict[str, Any]) -> list[str]:
    """What `status` says of a run's validations (run.json's last_eval, best_eval, last_completions)."""
    lines = []
    for key, label in (("last_eval", "last eval"), ("best_eval", "best eval")):
        e = extra.get(key)
        if e:
            lines.append(
                f"{label}: step {e['step']}, loss {e['eval_loss']}, perplexity {e['eval_perplexity']}"
            )
    said = extra.get("last_completions")
    return lines + (completion_lines(said) if said else [])


def completion_lines(said: dict[str, Any]) -> list[str]:
    """A validation's completions (run.json's last_completions), one line per prompt."""
    lines = [f"model says (step {said['step']}, greedy):"]
    for c in said.get("completions", []):
        # As JSON strings: a newline in a prompt or a completion shows as \n, on the line
        prompt = json.dumps(c["prompt"], ensure_ascii=False)
        lines.append(f"  {prompt} -> {json.dumps(c['completion'], ensure_ascii=False)}")
    return lines
