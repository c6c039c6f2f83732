"""Which checkpoint to resume from and which to delete: decisions over names, not files."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

TAG_PATTERN = re.compile(r"^step-(\d{6,})$")


def tag_for_step(step: int) -> str:
    return f"step-{step:06d}"


def step_of_tag(tag: str) -> int | None:
    match = TAG_PATTERN.match(tag)
    return int(match.group(1)) if match else None


def _step_key(tag: str) -> int:
    """A tag's step, for sorting tags already known to be checkpoint tags."""
    step = step_of_tag(tag)
    assert step is not None, tag
    return step


@dataclass(frozen=True)
class CheckpointListing:
    """What the store saw on disk: committed tags (manifest present) and the `latest` pointer."""

    committed: tuple[str, ...]
    latest: str | None


def choose_resume_tag(listing: CheckpointListing, rejected: Iterable[str] = ()) -> str | None:
    """The checkpoint a (re)start loads.

    `latest` wins when it is committed and not rejected (e.g. failed verification); otherwise the newest
    committed one: `latest` is written last, so a crash between the commit and the pointer leaves a
    newer committed tag that is still good.
    """
    bad = set(rejected)
    good = sorted(
        (t for t in listing.committed if t not in bad and step_of_tag(t) is not None), key=_step_key
    )
    if not good:
        return None
    newest = good[-1]
    if listing.latest in good and step_of_tag(listing.latest) == step_of_tag(newest):
        return listing.latest
    return newest


def tags_to_delete(committed: Iterable[str], keep_last: int, protect: Iterable[str] = ()) -> list[str]:
    """Committed tags beyond the newest `keep_last`, except protected ones (e.g. the one being loaded)."""
    keep = set(protect)
    ordered = sorted((t for t in committed if step_of_tag(t) is not None), key=_step_key)
    doomed = ordered[:-keep_last] if keep_last > 0 else ordered
    return [t for t in doomed if t not in keep]


def newest_at_or_before(committed: Iterable[str], step: int) -> str | None:
    """The newest committed tag of a step at or before `step`, or None."""
    steps = [(s, t) for t in committed if (s := step_of_tag(t)) is not None and s <= step]
    return max(steps)[1] if steps else None


def prune_leaves_no_fallback(
    committed: Iterable[str], new: str, keep_last: int, rejected: Iterable[str] = ()
) -> bool:
    """Would pruning after committing `new` remove every checkpoint a restart could fall back to?

    Then `new` must be read back and verified first (its hashes were taken from memory): with
    `keep_last: 1` a bad new checkpoint would otherwise be the only one left.
    """
    bad = set(rejected) | {new}
    doomed = set(tags_to_delete(committed, keep_last, protect=(new,)))
    return bool(doomed) and not [t for t in committed if t not in doomed and t not in bad]
