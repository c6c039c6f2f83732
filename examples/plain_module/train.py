"""The same run from Python, passing the pieces themselves (elastictrain.fit).

python examples/plain_module/train.py --local     # one worker in this process: use a debugger
python examples/plain_module/train.py             # Ray workers, as the config's scaling says
"""

from __future__ import annotations

import sys
from pathlib import Path

import elastictrain

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # so `plain_module` imports here (and, via PYTHONPATH, in workers)

from plain_module.model import build_dataset, build_model, mse_loss  # noqa: E402


def main(argv: list[str]) -> int:
    local = "--local" in argv
    overrides = [a for a in argv if "=" in a]
    summary = elastictrain.fit(
        HERE / "config.yaml",
        overrides,
        model=build_model,
        dataset=build_dataset,
        loss=mse_loss,
        local=local,
        tracking="--no-tracking" not in argv,
    )
    print(f"{summary.status.value} at step {summary.step}")
    return 0 if summary.status.value == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
