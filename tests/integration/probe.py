"""Warm worker actors that tests can look inside: the product's TrainWorker plus two read-only probes.

A `ProbeGroup` keeps N actors alive across many attempts (as the worker group does), joins them into
an attempt at any world size with the product's own `TrainWorker.setup` (model built under zero.Init,
engine, checkpoint loaded), and then reads what the engine holds: every parameter gathered, or the
logits of a batch. Nothing here trains; `setup` is the code under test.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from elastictrain.worker.actor import TrainWorker


class ProbeWorker(TrainWorker):
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the engine's model, gathered from its ZeRO-3 partitions (named once if tied)."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        zero3 = [p for p in params.values() if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(zero3, modifier_rank=None):
            return {name: p.detach().to("cpu", copy=True) for name, p in params.items()}

    def tied_names(self) -> list[list[str]]:
        """Groups of module attribute names that share one parameter object (e.g. embeddings and head)."""
        by_param: dict[int, list[str]] = {}
        for name, p in self.engine.module.named_parameters(remove_duplicate=False):
            by_param.setdefault(id(p), []).append(name)
        return [names for names in by_param.values() if len(names) > 1]

    def partition_copies(self) -> dict[str, int]:
        """Distinct storages behind ZeRO-3's per-rank flat tensors (training weights, fp32 master,
        gradient buffer, the optimizer's gradients where it keeps them, Adam's moments), how many of the
        groups' masters are the weights, and how many optimizer gradients lie in the gradient buffer."""
        opt = self.engine.optimizer
        flats = [*opt.fp16_partitioned_groups_flat, *opt.fp32_partitioned_groups_flat]
        flats.append(opt.grad_partitions_flat_buffer)
        for state in opt.optimizer.state.values():
            flats += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
        shared = sum(
            m.data_ptr() == w.data_ptr()
            for m, w in zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat, strict=True)
        )
        flat = opt.grad_partitions_flat_buffer.untyped_storage().data_ptr()
        grads = [m.grad for m in opt.fp32_partitioned_groups_flat if m.grad is not None]
        flats += grads
        in_flat = sum(g.untyped_storage().data_ptr() == flat for g in grads)
        return {
            "storages": len({t.untyped_storage().data_ptr() for t in flats}),
            "shared_masters": shared,
            "grads_in_flat_buffer": in_flat,
        }

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The engine's logits for `ids`, in eval mode (no dropout); every rank must call it together."""
        module = self.engine.module
        module.eval()
        try:
            with torch.no_grad():
                return self.engine(input_ids=ids.to(self.engine.device)).logits.float().cpu()
        finally:
            module.train()


class ProbeGroup:
    def __init__(self, size: int) -> None:
        import ray
        import ray.cloudpickle

        # The test folder is not importable on Ray's workers: ship this module by value.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        cls = ray.remote(num_cpus=0)(ProbeWorker)
        self.actors = [cls.remote(f"probe-{i}", False) for i in range(size)]
        self.attempt = 0
        self.warm = False

    def setup(
        self,
        config: Any,
        world_size: int,
        checkpoint_dir: str | None = None,
        step: int = 0,
        snapshot_every: int = 0,
        reference: Any = None,
    ) -> None:
        """Join the first `world_size` actors into a fresh attempt, exactly as a run's workers join one
        (in-memory snapshots every `snapshot_every` steps, no buddies; a preference run's reference
        table)."""
        import ray

        from elastictrain.config.deepspeed_config import build_deepspeed_config
        from elastictrain.core.batch import plan_batch
        from elastictrain.worker.attempt import AttemptSpec

        self.teardown()
        if not self.warm:
            # As the worker group warms every new actor before its first attempt: imports, compiled ops,
            # then gc.freeze(), without which each engine build and teardown collects all of them.
            ray.get([a.warmup.remote(config) for a in self.actors], timeout=300)
            self.warm = True
        self.attempt += 1
        t = config.training
        plan = plan_batch(t.global_batch_size, t.micro_batch_size, world_size)
        assert plan is not None
        ds_config = build_deepspeed_config(config, plan.micro_batch_size, plan.grad_accum_steps, world_size)
        port = ray.get(self.actors[0].free_port.remote())
        specs = [
            AttemptSpec(
                attempt=self.attempt,
                rank=rank,
                world_size=world_size,
                master_addr="127.0.0.1",
                master_port=port,
                backend="gloo",
                plan=plan,
                config=config,
                ds_config=ds_config,
                checkpoint_dir=checkpoint_dir,
                start_step=step,
                snapshot_every=snapshot_every,
                reference=reference,
            )
            for rank in range(world_size)
        ]
        self.active = self.actors[:world_size]
        ray.get([a.setup.remote(s) for a, s in zip(self.active, specs, strict=True)], timeout=300)

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self.active], timeout=300)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._all("full_parameters")[0]

    def tied_names(self) -> list[list[str]]:
        return self._all("tied_names")[0]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self._all("logits", ids)[0]

    def partition_copies(self) -> list[dict[str, int]]:
        return self._all("partition_copies")

    def teardown(self) -> None:
        import ray

        if getattr(self, "active", None):
            ray.get([a.teardown.remote() for a in self.active], timeout=120)
        self.active = []

    def alive(self) -> bool:
        """Whether every actor still answers (a test may have killed one, or its cluster is gone)."""
        import ray

        try:
            ray.get([a.info.remote() for a in self.actors], timeout=60)
        except Exception:  # noqa: BLE001 - any failure: a new group
            return False
        return True

    def kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


def train_steps(group: ProbeGroup, steps: range) -> list[float]:
    """Run the workers' real `train_step` for each step; each step's loss as the controller reports it."""
    import ray

    from elastictrain.core.losses import step_loss

    losses = []
    for step in steps:
        results = ray.get([a.train_step.remote(step) for a in group.active], timeout=300)
        losses.append(step_loss(results))
    return losses


def save_checkpoint(group: ProbeGroup, config: Any, root: Any, step: int) -> Any:
    """Each rank writes its fragment file (`save_shard`); the product's store commits them as a checkpoint."""
    import ray

    from elastictrain.checkpoint.store import CheckpointStore

    store = CheckpointStore(root)
    staging = store.begin(step)
    outs = ray.get([a.save_shard.remote(str(staging)) for a in group.active], timeout=300)
    fields = {
        "world_size": len(group.active),
        "engine_state": outs[0]["engine_state"],
        "model": {"hf_config": dict(config.model.hf_config)},
    }
    return store.commit(step, staging, [o["file"] for o in outs], fields).path


def assert_same_state(a: Path, b: Path) -> list[str]:
    """Every saved field of every parameter equal in checkpoints a and b; returns the fields compared."""
    from elastictrain.checkpoint.zero_state import FragmentReader

    ra = FragmentReader(sorted(a.glob("*.safetensors")))
    rb = FragmentReader(sorted(b.glob("*.safetensors")))
    assert set(ra.params) == set(rb.params) and ra.params
    for name in ra.params:
        assert ra.fields(name) == rb.fields(name), (name, ra.fields(name), rb.fields(name))
        for field in ra.fields(name):
            x, y = ra.full(name, field), rb.full(name, field)
            assert x.shape == y.shape and bool((x == y).all()), f"{name}::{field} differs: {a} -> {b}"
    some = next(iter(ra.params))
    moments = [f for f in ra.fields(some) if f != "fp32"]
    assert moments and all(float(ra.full(some, f).abs().sum()) > 0 for f in moments), "untrained state"
    return ra.fields(some)
