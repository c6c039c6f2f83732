"""Failure handling: replies of the workers -> a `Failure` (decided on by core), teardown of survivors."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from elastictrain.cluster.calls import DIED, NODE_LOST, OUT_OF_MEMORY, RAISED, TIMED_OUT, Calls, Group, Reply
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.errors import AttemptFailed
from elastictrain.control.record import RunRecorder
from elastictrain.core.membership import WorkerObservation, stalled_workers
from elastictrain.core.policy import Failure

log = logging.getLogger(__name__)

TEARDOWN_TIMEOUT_S = 5.0  # a survivor that cannot leave its attempt in this time is replaced
ABORT_TIMEOUT_S = 2.0  # for the survivors' control threads to abort their process groups
HAND_OFF_TIMEOUT_S = 30.0  # for a replaced survivor to pass its in-memory snapshots on


def gather_results(
    group: Group,
    calls: Calls,
    step: int,
    *,
    timeout_s: float,
    phase: str,
) -> dict[str, Any]:
    """Results of one call on every active worker; raises AttemptFailed naming the root cause."""
    replies = group.gather(calls, timeout_s, stop_on_error=True)
    if all(r.ok for r in replies.values()):
        return {wid: replies[wid].value for wid in calls}
    raise AttemptFailed(classify(group, replies, step, phase, timeout_s))


def classify(group: Group, replies: dict[str, Reply], step: int, phase: str, timeout_s: float) -> Failure:
    killed = {wid: r.detail for wid, r in replies.items() if r.error == OUT_OF_MEMORY}
    if killed:
        return Failure(
            "out_of_memory",
            tuple(killed),
            step,
            f"killed by Ray's memory monitor during {phase}: {', '.join(killed)} "
            f"({memory_report(next(iter(killed.values())))})",
            detail=next(iter(killed.values())),
        )
    dead = [wid for wid, r in replies.items() if r.error in (DIED, NODE_LOST)]
    if dead:
        lost_nodes = {replies[w].node_id for w in dead if replies[w].error == NODE_LOST}
        kind = "node_lost" if lost_nodes else "worker_died"
        what = f"node(s) {', '.join(n[:8] for n in lost_nodes)} lost" if lost_nodes else "worker process died"
        return Failure(kind, tuple(dead), step, f"{what} during {phase}: {', '.join(dead)}")
    raised = {wid: r.detail for wid, r in replies.items() if r.error == RAISED}
    if raised:
        # Prefer the worker whose error is its own, not a broken collective.
        own = {w: e for w, e in raised.items() if not is_collective_error(e)} or raised
        wid, err = next(iter(own.items()))
        return Failure(
            "setup_error" if phase == "setup" else "step_error",
            tuple(own),
            step,
            f"{phase} raised in {wid}: {short(err)}",
            detail=err,
        )
    silent = [wid for wid, r in replies.items() if r.error == TIMED_OUT]
    return classify_hang(group, step, phase, timeout_s, silent, among=list(replies))


def classify_hang(
    group: Group, step: int, phase: str, timeout_s: float, silent: Sequence[str], *, among: Sequence[str]
) -> Failure:
    """No answer in time: the suspects are the workers that are gone, else those not waiting on the others.

    Only the attempt's workers (`among`) are observed: a spare or a warm worker waiting to join a grow
    is in no collective and would look like the one that stalled the group.
    """
    progress = {wid: p for wid, p in group.progress(timeout_s=5.0).items() if wid in among}
    alive = group.nodes_alive()  # one cluster query for every worker
    node_of = {w.worker_id: w.node_id for w in group.workers}
    observations = [
        WorkerObservation(
            worker_id=wid,
            answering=p is not None,
            node_alive=node_of.get(wid) in alive,
            last_progress=p["since"] if p else 0.0,
            step=p["step"] if p else step,
            in_collective=bool(p and p["in_collective"]),
        )
        for wid, p in progress.items()
    ]
    dead = [o.worker_id for o in observations if not o.answering or not o.node_alive]
    suspects = tuple(dead) or (stalled_workers(observations) if observations else tuple(silent))
    where = "; ".join(f"{w}: {progress[w]['where']}" for w in suspects if progress.get(w))  # type: ignore[index]
    return Failure(
        "hang",
        suspects,
        step,
        f"no progress in {phase} for {timeout_s:.0f}s (failure.hang_timeout_s); "
        f"stalled: {', '.join(suspects)}" + (f" at {where}" if where else ""),
    )


def remove_at_fault(group: Group, failure: Failure) -> None:
    """The workers at fault are replaced; everyone else keeps its actor.

    A rank whose step raised is replaced too: its peers wait for it inside a gloo collective, and
    only its process exiting releases them at once (and after a CUDA error its process is not to be
    trusted anyway).
    """
    by_id = {w.worker_id: w for w in group.workers}
    for wid in failure.worker_ids:
        if wid in by_id:
            group.remove(by_id[wid])


def teardown(
    group: Group,
    active: Sequence[Any],
    recorder: RunRecorder,
    step: int,
    *,
    hand_off: bool = False,
    abort: bool = False,
) -> None:
    """Tear the attempt down on every surviving worker; a worker that cannot is replaced.

    With `abort` (after a failure), every survivor first aborts its process groups from its control
    thread: one blocked in a collective with a rank that is gone (in a ring, even one waiting on a
    live rank that already left) is released in a second, rather than replaced after the teardown
    timeout, which would cost a new actor's start. With `hand_off`, a worker about to be replaced
    first sends its in-memory snapshots (its control thread answers while its training thread is
    stuck) to a survivor that left cleanly.
    """
    survivors = [w for w in group.workers if w in active]
    if abort and survivors:
        group.gather(group.call(survivors, WorkerApi.abort_collectives, control=True), ABORT_TIMEOUT_S)
    replies = group.gather(group.call(survivors, WorkerApi.teardown), TEARDOWN_TIMEOUT_S)
    stuck: dict[str, str] = {}
    for w in survivors:
        r = replies[w.worker_id]
        if r.error == TIMED_OUT:
            stuck[w.worker_id] = f"teardown did not finish in {TEARDOWN_TIMEOUT_S:.0f}s"
        elif not r.ok:
            stuck[w.worker_id] = short(r.detail)
    if not stuck:
        return
    progress = group.progress(timeout_s=2.0)
    leaving = [w for w in survivors if w.worker_id in stuck]
    clean = [w for w in survivors if w.worker_id not in stuck]
    if hand_off and clean:
        calls = group.call(leaving, WorkerApi.hand_off_snapshots, clean[0].actor, control=True)
        for wid, r in group.gather(calls, HAND_OFF_TIMEOUT_S).items():
            stuck[wid] += f"; its in-memory snapshots {'handed to ' + clean[0].worker_id if r.ok else 'lost'}"
    for w in leaving:
        where = (progress.get(w.worker_id) or {}).get("where", "")
        recorder.event(
            "worker_replaced",
            f"worker {w.worker_id} could not leave the attempt "
            f"({stuck[w.worker_id]}; at {where or 'unknown'}); replacing it",
            step=step,
            worker=w.worker_id,
            where=where,
        )
        group.remove(w)


def is_disk_full(text: str) -> bool:
    return any(s in text for s in ("No space left on device", "Errno 28", "Disk quota exceeded", "Errno 122"))


def memory_report(text: str) -> str:
    """The sentence of Ray's out-of-memory message that says how full the node was."""
    for sentence in text.replace("\n", " ").split(". "):
        if "Memory on the node" in sentence:
            # Ray 2.60 runs on into its kill reason and object store figures: the usage is what matters.
            return sentence.split(" OOM kill reason")[0].strip().rstrip(".")
    return short(text) if text.strip() else "the node ran short of memory"


def is_collective_error(text: str) -> bool:
    return any(
        s in text for s in ("Connection closed by peer", "Connection reset", "gloo", "NCCL", "Timed out")
    )


def short(e: BaseException | str) -> str:
    """The last line of an error or of a worker's error report (its traceback ends with 'Type: message')."""
    text = str(e).strip().splitlines()
    if text:
        return text[-1][:300]
    return "unknown error" if isinstance(e, str) else type(e).__name__


def leave_workers(
    group: Group, recorder: RunRecorder, step: int, teardown_active: Callable[[], None] | None
) -> None:
    """End the workers: the last attempt is left cleanly (each rank removes its /dev/shm buffers),
    then the actors go; buffers of dead ranks on this host are removed here."""
    from elastictrain.rundir.liveness import remove_dead_buffers

    try:
        if teardown_active is not None:
            teardown_active()
    except Exception as e:  # noqa: BLE001 - the actors are killed below all the same
        log.warning("teardown at the end of the run: %s", e)
    group.shutdown()
    try:
        removed = remove_dead_buffers(recorder.run_dir.read_events())
    except OSError as e:
        log.warning("removing /dev/shm buffers: %s", e)
        return
    if removed:
        recorder.quiet_event("shm_buffers_removed", step=step, paths=removed)
