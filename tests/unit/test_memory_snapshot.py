"""In-memory snapshots: what a worker keeps, what a new rank fetches, and reading them back resharded."""

from __future__ import annotations

import torch

from elastictrain.checkpoint.zero_state import Fragment
from elastictrain.worker.snapshots.format import (
    MemoryReader,
    Snapshot,
    SnapshotKey,
    SnapshotStore,
    keys_to_fetch,
)

# One parameter "w" of 10 elements (shape 2x5) and one "b" of 3, split over two old ranks as ZeRO-3 would.
W = torch.arange(10, dtype=torch.float32)
B = torch.tensor([100.0, 101.0, 102.0])
M = W * -1  # an optimizer moment, elementwise like the weights


def old_rank(rank: int) -> Snapshot:
    w_lo, w_hi = (0, 5) if rank == 0 else (5, 10)
    b_lo, b_hi = (0, 2) if rank == 0 else (2, 3)
    tensors = {
        "w::fp32": W[w_lo:w_hi].clone(),
        "w::exp_avg": M[w_lo:w_hi].clone(),
        "b::fp32": B[b_lo:b_hi].clone(),
        "b::exp_avg": B[b_lo:b_hi].clone() * 0,
    }
    fragments = {"w": Fragment(w_lo, w_hi - w_lo, 10, (2, 5)), "b": Fragment(b_lo, b_hi - b_lo, 3, (3,))}
    return Snapshot(SnapshotKey(1, 2, rank, 7), tensors, fragments, {"optimizer_state": {}})


def test_a_new_rank_fetches_only_the_fragments_overlapping_its_slices_and_reads_them_back():
    metas = {r: old_rank(r).meta() for r in (0, 1)}
    # New world size 3: this rank loads w[4:8) and nothing of b.
    plan = keys_to_fetch(metas, [("w", 4, 4)], full_fp32=False)
    assert plan == {0: ["w::fp32", "w::exp_avg"], 1: ["w::fp32", "w::exp_avg"]}
    fetched = {r: {k: old_rank(r).tensors[k] for k in keys} for r, keys in plan.items()}
    reader = MemoryReader(metas, fetched)
    assert torch.equal(reader.read("w", "fp32", 4, 4), W[4:8])
    assert torch.equal(reader.read("w", "exp_avg", 4, 4), M[4:8])
    assert reader.fields("w") == ["fp32", "exp_avg"]
    assert reader.params["w"] == Fragment(0, 10, 10, (2, 5)) and reader.params["b"].numel == 3


def test_a_layout_that_needs_whole_weights_fetches_every_fp32_fragment():
    metas = {r: old_rank(r).meta() for r in (0, 1)}
    plan = keys_to_fetch(metas, [("w", 0, 2)], full_fp32=True)
    assert plan == {0: ["w::fp32", "w::exp_avg", "b::fp32"], 1: ["w::fp32", "b::fp32"]}
    fetched = {r: {k: old_rank(r).tensors[k] for k in keys} for r, keys in plan.items()}
    reader = MemoryReader(metas, fetched)
    assert torch.equal(reader.full("w"), W.view(2, 5)) and torch.equal(reader.full("b"), B)


def test_a_worker_keeps_its_last_two_complete_snapshots_and_two_replicas():
    store = SnapshotStore()
    for step in (5, 6, 7):
        store.add_own(Snapshot(SnapshotKey(1, 2, 0, step), {"w::fp32": W.clone()}, {}, {}))
    store.add_replica(Snapshot(SnapshotKey(1, 2, 1, 7), {"w::fp32": W.clone()}, {}, {}))
    held = store.holdings()
    assert [(h["rank"], h["step"], h["own"]) for h in held] == [(0, 6, True), (0, 7, True), (1, 7, False)]
    assert store.find(SnapshotKey(1, 2, 0, 5)) is None  # the oldest went when the third was complete
    assert store.nbytes() == 3 * W.numel() * 4


def test_a_replica_survives_the_wire_as_its_own_copy():
    snap = old_rank(1)
    wire = snap.to_wire()
    back = Snapshot.from_wire(wire)
    wire["flat"][:] = 0  # the sender's buffer changing later does not touch the replica
    assert back.key == snap.key and list(back.tensors) == list(snap.tensors)
    assert all(torch.equal(back.tensors[k], t) for k, t in snap.tensors.items())


def test_a_snapshot_goes_on_the_wire_as_the_one_buffer_its_tensors_view_and_a_replica_does_again():
    import numpy as np

    from elastictrain.checkpoint.rank_snapshot import Snapshot as RankSnapshot

    buffer = torch.arange(8, dtype=torch.float32)
    plan = type("Plan", (), {"keys": {"w::fp32": (0, 5), "b::fp32": (5, 3)}})()
    raw = RankSnapshot(plan, buffer, {})  # type: ignore[arg-type]
    own = Snapshot(SnapshotKey(1, 2, 0, 7), raw.tensors(), {}, {}, raw=raw)
    wire = own.to_wire()
    assert np.shares_memory(wire["flat"], buffer.numpy())  # not copied on the sender's side
    assert wire["layout"] == {"w::fp32": (0, 5), "b::fp32": (5, 3)}
    replica = Snapshot.from_wire(wire)
    assert torch.equal(replica.tensors["b::fp32"], torch.tensor([5.0, 6.0, 7.0]))
    handed = replica.to_wire()  # a replaced worker hands its replicas on the same way
    assert np.shares_memory(handed["flat"], replica.flat.numpy()) and handed["layout"] == wire["layout"]


def test_a_rank_at_another_tensor_parallel_degree_fetches_every_slice_of_what_it_holds_and_cuts_its_own():
    from elastictrain.checkpoint.tensor_slices import TensorSlice

    whole = torch.arange(24, dtype=torch.float32).view(4, 6)  # sliced along dim 1 at degree 2

    def tp_rank(index: int) -> Snapshot:
        piece = TensorSlice(1, index, 2)
        held = piece.cut(whole, "o").contiguous().reshape(-1)
        name = piece.qualify("o")
        tensors = {f"{name}::fp32": held.clone(), "n::fp32": B.clone()}
        fragments = {name: Fragment(0, 12, 12, (4, 3)), "n": Fragment(0, 3, 3, (3,))}
        return Snapshot(SnapshotKey(1, 2, index, 7), tensors, fragments, {"optimizer_state": {}})

    metas = {r: tp_rank(r).meta() for r in (0, 1)}
    # The same degree: rank 1 fetches its own slice only.
    same = TensorSlice(1, 1, 2).qualify("o")
    assert keys_to_fetch(metas, [(same, 0, 12)], full_fp32=False) == {1: [f"{same}::fp32"]}
    # Degree 1 (the whole parameter), then degree 3: every slice moves, and the reader cuts.
    for target, expected in (("o", whole), (TensorSlice(1, 2, 3).qualify("o"), whole[:, 4:6])):
        n = expected.numel()
        plan = keys_to_fetch(metas, [(target, 0, n)], full_fp32=False)
        assert sorted(plan) == [0, 1] and all(len(keys) == 1 for keys in plan.values())
        fetched = {r: {k: tp_rank(r).tensors[k] for k in keys} for r, keys in plan.items()}
        reader = MemoryReader(metas, fetched)
        assert torch.equal(reader.read(target, "fp32", 0, n), expected.reshape(-1))
