"""Issue 13: every ZeRO stage trains and its checkpoints reshard, across world sizes and across stages.

Three warm actors (tests/integration/probe.py) join attempts through the product's TrainWorker: they
train real steps, save their fragments, and load them at another world size or under another stage.
After each load the state saved again must equal the state loaded, element by element, for the fp32
weights and every optimizer state tensor; and the next step's loss must be the loss a run that never
changed size computes, to within fp32 summation-order noise (1e-5 on a loss of about 5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, tiny_config
from probe import ProbeGroup, assert_same_state, save_checkpoint, train_steps

pytestmark = pytest.mark.integration

NEXT_LOSS_TOL = 1e-5


def reshard_round_trip(probes: ProbeGroup, cfg: Any, root: Path, load_cfg: Any | None = None) -> list[str]:
    """Train 3 steps at world size 2; reload at 3 and 1 (under load_cfg's stage); compare state and loss."""
    load_cfg = load_cfg or cfg
    probes.setup(cfg, world_size=2)
    train_steps(probes, range(3))
    w2 = save_checkpoint(probes, cfg, root / "w2", 3)
    (fixed_next,) = train_steps(probes, range(3, 4))  # the run that never changed size

    fields = []
    for world in (3, 1):
        probes.setup(load_cfg, world_size=world, checkpoint_dir=str(w2), step=3)
        again = save_checkpoint(probes, load_cfg, root / f"w2-to-{world}", 3)
        fields = assert_same_state(w2, again)
        (resumed_next,) = train_steps(probes, range(3, 4))
        assert abs(resumed_next - fixed_next) <= NEXT_LOSS_TOL, (world, resumed_next, fixed_next)
    saved = json.loads((w2 / "manifest.json").read_text())["engine_state"]["optimizer_state"]
    assert "step" not in saved or saved["step"]["value"] == 3  # SGD counts no steps
    return fields


# Stage 3 without offload is the next test's run (fp32 is the tiny config's precision).
@pytest.mark.parametrize(
    ("stage", "offload"), [(0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu")]
)
def test_checkpoints_of_every_stage_reshard_2_to_3_and_2_to_1(probes, tmp_path, stage, offload):
    cfg = tiny_config(
        tmp_path / "run", f"deepspeed.zero_stage={stage}", f"deepspeed.offload_optimizer={offload}"
    )
    assert reshard_round_trip(probes, cfg, tmp_path) == ["fp32", "exp_avg", "exp_avg_sq"]


def test_a_fp32_zero3_rank_keeps_one_copy_of_its_partition_and_its_checkpoints_reshard(probes, tmp_path):
    # DeepSpeed 0.19 would hold a second fp32 copy as the optimizer's master: 5 storages, none shared.
    cfg = tiny_config(tmp_path / "run", "deepspeed.zero_stage=3", "training.precision=fp32")
    assert reshard_round_trip(probes, cfg, tmp_path) == ["fp32", "exp_avg", "exp_avg_sq"]
    copies = probes.partition_copies()  # at world size 1, after a step: Adam's moments exist
    assert copies == [{"storages": 4, "shared_masters": 1, "grads_in_flat_buffer": 0}] * len(copies)


def test_a_zero3_rank_with_its_optimizer_offloaded_keeps_its_gradients_once_and_its_checkpoints_reshard(
    probes, tmp_path
):
    # DeepSpeed 0.19 copies the reduced gradients into a second host buffer for the offloaded optimizer:
    # 6 storages. Shared: weights, master, gradient buffer, two moments. (Exactness of the update:
    # test_offloaded_gradients.py.)
    cfg = tiny_config(tmp_path / "run", "deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu")
    assert reshard_round_trip(probes, cfg, tmp_path) == ["fp32", "exp_avg", "exp_avg_sq"]
    copies = probes.partition_copies()
    assert copies == [{"storages": 5, "shared_masters": 0, "grads_in_flat_buffer": 1}] * len(copies)


# Each saver's layout once into another: ZeRO-3 into ZeRO-1 stands for ZeRO-2 too (one optimizer class).
@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (0, 3), (3, 1)])
def test_a_checkpoint_of_one_stage_loads_under_another(probes, tmp_path, saved, loaded):
    cfg = tiny_config(tmp_path / "run", f"deepspeed.zero_stage={saved}")
    other = tiny_config(tmp_path / "run", f"deepspeed.zero_stage={loaded}")
    reshard_round_trip(probes, cfg, tmp_path, load_cfg=other)


HF_JSONS = REPO / "conf" / "deepspeed"


@pytest.mark.parametrize("name", ["hf-zero2.json", "hf-zero3-offload.json"])
def test_a_hugging_face_style_json_without_optimizer_trains_and_reshards(probes, tmp_path, name):
    """No optimizer block, "auto" values, a scheduler block: AdamW comes from training.*, state reshards."""
    assert "optimizer" not in json.loads((HF_JSONS / name).read_text())
    cfg = tiny_config(tmp_path / "run", f"deepspeed.config_file={HF_JSONS / name}")
    assert reshard_round_trip(probes, cfg, tmp_path) == ["fp32", "exp_avg", "exp_avg_sq"]


@pytest.mark.parametrize(
    ("stage", "optimizer", "fields"),
    [
        # SGD under ZeRO-3, a non-Adam state under ZeRO-2: the two layouts the state is found in.
        (3, {"type": "SGD", "params": {"lr": "auto", "momentum": 0.9}}, ["fp32", "momentum_buffer"]),
        (2, {"type": "Adagrad", "params": {"lr": "auto"}}, ["fp32", "sum"]),
    ],
    ids=["sgd-zero3", "adagrad-zero2"],
)
def test_optimizers_beyond_adam_reshard_their_state(probes, tmp_path, stage, optimizer, fields):
    """The state to reshard is found by inspection: SGD's momentum, Adagrad's sum of squares."""
    ds = {
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "optimizer": optimizer,
        "gradient_clipping": "auto",
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = tiny_config(tmp_path / "run", f"deepspeed.config_file={path}", "training.lr=0.05")
    assert reshard_round_trip(probes, cfg, tmp_path) == fields
