"""Waiting for calls to Ray actors and reading each one's outcome as a typed `Reply`, never raising."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError

from elastictrain.cluster.calls import DIED, OUT_OF_MEMORY, RAISED, TIMED_OUT, Calls, Reply


def gather_replies(
    calls: Calls, timeout_s: float, *, stop_on_error: bool = False, grace_s: float = 3.0
) -> dict[str, Reply]:
    """Each call's reply within `timeout_s` (TIMED_OUT for those without one). `stop_on_error`: the
    first error ends the wait, the others get `grace_s` more to answer."""
    pending = {ref: wid for wid, ref in calls.items()}
    replies: dict[str, Reply] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = max(0.0, deadline - time.monotonic())
        if stop_on_error:  # one at a time, to notice the first error at once
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(1.0, left))
        else:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=left)
        for ref in ready:
            wid = pending.pop(ref)
            replies[wid] = reply_of(wid, ref)
            if stop_on_error and not replies[wid].ok:
                ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
                for other, owid in pending.items():
                    replies[owid] = reply_of(owid, other)
                pending.clear()
                break
        if pending and time.monotonic() >= deadline:
            break
    for wid in pending.values():
        replies[wid] = Reply(wid, error=TIMED_OUT, detail=f"no answer in {timeout_s:.0f}s")
    return replies


def reply_of(worker_id: str, ref: Any) -> Reply:
    """The outcome of a finished (or, if not finished, timed-out) call, without waiting."""
    try:
        return Reply(worker_id, ray.get(ref, timeout=0))
    except OutOfMemoryError as e:  # the memory monitor killed the actor: not the worker's own error
        return Reply(worker_id, error=OUT_OF_MEMORY, detail=str(e))
    except RayActorError as e:
        return Reply(worker_id, error=DIED, detail=str(e))
    except RayTaskError as e:
        # The worker's own exception (its message holds its traceback), not Ray's wrapping of it.
        cause = getattr(e, "cause", None)
        return Reply(worker_id, error=RAISED, detail=str(cause) if cause is not None else str(e))
    except GetTimeoutError:
        return Reply(worker_id, error=TIMED_OUT, detail="no answer yet")
    except Exception as e:  # noqa: BLE001 - e.g. an argument that cannot be unpickled: the call raised
        return Reply(worker_id, error=RAISED, detail=f"{type(e).__name__}: {e}")
