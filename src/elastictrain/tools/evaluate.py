"""`elastictrain eval`: the validation of any committed checkpoint, offline, in this process.

The run's own worker code at world size 1 (as `--local`): the checkpoint is loaded by reading every
fragment (checkpoints do not depend on the world size), then `eval.steps` global batches of the
validation set are read exactly as during training, so the numbers match the run's `eval` events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastictrain.checkpoint.model_record import configured_model, model_mismatch
from elastictrain.config.eval_check import evaluates


def evaluate_checkpoint(config: Any, checkpoint: Path) -> dict[str, Any]:
    """Validation loss, perplexity, tokens and samples of `checkpoint` under the run's `config`, and
    with eval.prompts what the model says (`completions`)."""
    from elastictrain.control.specs import single_rank_spec
    from elastictrain.core.losses import eval_summary
    from elastictrain.worker.actor import TrainWorker

    if not evaluates(config):
        raise ValueError(
            "eval: this run has no validation set; give eval.steps (> 0) and eval.split or eval.data, "
            "e.g. `elastictrain eval RUN_DIR eval.steps=2` for a run that has eval.split"
        )
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    # The same record of the model that resume and export read: never evaluate another model's weights.
    mismatch = model_mismatch(manifest, configured_model(config))
    if mismatch:
        raise ValueError(
            f"{checkpoint} was saved from another model than this config's: {'; '.join(mismatch[:5])}"
        )
    step = int(manifest["step"])
    worker = TrainWorker("eval", config.scaling.use_gpu)
    spec = single_rank_spec(config, checkpoint_dir=str(checkpoint), start_step=step)
    try:
        worker.setup(spec)
        result = worker.evaluate(step)
        said = {"completions": result["completions"]} if "completions" in result else {}
        return {"step": float(step), **eval_summary([result]), **said}
    finally:
        worker.teardown()
