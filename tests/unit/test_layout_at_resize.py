"""Auto layout fields chosen again at every world size by the control loop (on the fake worker group)."""

from __future__ import annotations

from pathlib import Path

from loop_harness import make_run

from elastictrain.core.layout import Memory, ModelShape, choose_layout
from elastictrain.core.memory_estimate import GIB
from elastictrain.driver.layout_auto import LayoutChooser, fixed_values

# A 1B decoder's numbers: the fake workers train nothing, the choice reads only these.
SHAPE = ModelShape(
    params=1_100_000_000,
    largest_layer=65_536_000,
    hidden=2048,
    intermediate=5632,
    kv_width=2048,
    layers=16,
    vocab=32000,
    zero3_live=10**9,
)
AUTO = ("deepspeed.zero_stage=auto", "training.micro_batch_size=auto", "training.global_batch_size=24")


def _choice(world: int, host_gib: float):
    return choose_layout(
        SHAPE,
        Memory(0, int(host_gib * GIB)),
        world_size=world,
        data_parallel=world,
        global_batch_size=24,
        seq_len=64,
        precision="fp32",
        fixed={"offload_optimizer": "none", "offload_param": "none", "activation_checkpointing": False},
    )


def _host_where(wanted) -> float:
    """The first host share per rank (0.5 GiB steps) at which the choices at 3 and 2 ranks are as wanted."""
    for half_gib in range(8, 200):
        if wanted(_choice(3, half_gib / 2), _choice(2, half_gib / 2)):
            return half_gib / 2
    raise AssertionError("no such memory")


def _auto_run(tmp_path: Path, host_gib: float):
    def start(cfg):
        chooser = LayoutChooser(cfg, SHAPE, Memory(0, int(host_gib * GIB)), fixed_values(cfg))
        chooser.apply(chooser.choose(3))  # what the start does, here for the size the run starts at
        return chooser

    r = make_run(tmp_path, "scaling.min_workers=1", "scaling.max_workers=3", *AUTO, capacity=3, layouts=start)
    stages: list[tuple[int, int, int]] = []
    r.controller.callbacks.after_attempt_start.append(
        lambda c: stages.append(
            (c.world_size, c.active[0].spec.ds_config["zero_optimization"]["stage"], c.plan.micro_batch_size)
        )
    )
    return r, stages


def test_a_shrink_that_no_longer_fits_moves_to_a_higher_stage_and_the_grow_moves_back(tmp_path: Path):
    host = _host_where(
        lambda at3, at2: at3.fits and at2.fits and at2.layout.zero_stage > at3.layout.zero_stage
    )
    r, stages = _auto_run(tmp_path, host)
    r.group.die_at_step(rank=2, step=5)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    assert [s[0] for s in stages] == [3, 2, 3]
    expected = {w: _choice(w, host).layout for w in (2, 3)}
    assert stages == [(w, expected[w].zero_stage, expected[w].micro_batch_size) for w, _, _ in stages]
    moves = r.events("layout")
    assert [(e["world_size"], e["zero_stage"]) for e in moves] == [
        (2, expected[2].zero_stage),
        (3, expected[3].zero_stage),
    ]
    assert moves[0]["message"].startswith(f"layout (auto) at world size 2: ZeRO-{expected[2].zero_stage}")


def test_a_shrink_to_a_size_where_nothing_fits_ends_the_run_saying_so_with_its_checkpoint_kept(
    tmp_path: Path,
):
    host = _host_where(lambda at3, at2: at3.fits and not at2.fits)
    r, _ = _auto_run(tmp_path, host)
    r.group.die_at_step(rank=2, step=5)
    summary = r.run()
    assert summary.status.value == "FAILED"
    assert "auto layout: nothing fits at world size 2" in summary.message
    assert "elastictrain resume" in summary.message
    assert r.committed_step() == 4
