"""Which checkpoint an offline command (export, verify, reshard, status) uses, and why not a newer one.

A `step-NNNNNN` folder without a readable `manifest.json` is not a checkpoint: its save never
committed (or the file was removed or damaged). Training then resumes from the newest committed one;
the commands say so instead of quietly using an older checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from elastictrain.checkpoint.store import MANIFEST, CheckpointError, CheckpointStore
from elastictrain.core.checkpoints import choose_resume_tag, step_of_tag
from elastictrain.storage import AnyPath, as_path


@dataclass(frozen=True)
class Choice:
    """The checkpoint folder used, and one line per newer folder passed over (with the reason)."""

    path: AnyPath
    passed_over: tuple[str, ...] = ()

    def describe(self) -> str:
        """'using X; not the newer ...' lines, or '' when the newest folder is the one used."""
        if not self.passed_over:
            return ""
        return f"using {self.path.name}, not a newer folder:\n" + "\n".join(
            f"  {line}" for line in self.passed_over
        )


def _unreadable_manifest(folder: AnyPath) -> str | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} does not read ({e})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        return f"its {MANIFEST} is not a checkpoint manifest (no 'files' list)"
    return None


def passed_over(root: AnyPath, chosen: str | None) -> tuple[list[str], list[str]]:
    """Folders newer than `chosen` that are not used, as (tags, reasons); also a stray `latest`."""
    store = CheckpointStore(root)
    chosen_step = step_of_tag(chosen) if chosen else None
    floor = -1 if chosen_step is None else chosen_step
    tags: list[str] = []
    reasons: list[str] = []
    if not root.is_dir():
        return tags, reasons
    folders = sorted(
        (p for p in root.iterdir() if p.is_dir() and step_of_tag(p.name) is not None),
        key=lambda p: step_of_tag(p.name) or 0,
    )
    latest = store.listing().latest
    for folder in folders:
        step = step_of_tag(folder.name) or 0
        if step <= floor:
            continue
        if not (folder / MANIFEST).is_file():
            why = f"it has no {MANIFEST} (its save never committed, or the file was removed)"
        else:
            why = _unreadable_manifest(folder) or "it was rejected"
        named = " (`latest` names it)" if latest == folder.name else ""
        tags.append(folder.name)
        reasons.append(f"{folder.name}: not a committed checkpoint: {why}{named}")
    if latest and latest != chosen and latest not in tags and not (root / latest).is_dir():
        reasons.append(f"`latest` names {latest}, which does not exist")
    return tags, reasons


@dataclass(frozen=True)
class Usable:
    """A checkpoints/ folder as a resume sees it."""

    committed: tuple[str, ...]  # checkpoints with a readable manifest, oldest first
    resume_tag: str | None  # the one a resume loads (None: none, the run starts at step 0)
    passed_over: tuple[str, ...]  # why each newer step folder is not used


def newest_usable(root: AnyPath) -> Usable:
    listing = CheckpointStore(root).listing()
    unreadable = tuple(t for t in listing.committed if _unreadable_manifest(root / t) is not None)
    tag = choose_resume_tag(listing, unreadable)
    committed = tuple(t for t in listing.committed if t not in unreadable)
    return Usable(committed, tag, tuple(passed_over(root, tag)[1]))


def choose_checkpoint(path: str | AnyPath) -> Choice:
    """A checkpoint folder as given, or the one a resume would load from a checkpoints/ or run folder."""
    p = as_path(path)
    if (p / MANIFEST).is_file():
        return Choice(p)
    for root in (p, p / "checkpoints"):
        usable = newest_usable(root)
        if usable.resume_tag is not None:
            return Choice(root / usable.resume_tag, usable.passed_over)
    _, reasons = passed_over(p / "checkpoints" if (p / "checkpoints").is_dir() else p, None)
    found = ("; found:\n" + "\n".join(f"  {r}" for r in reasons)) if reasons else ""
    raise CheckpointError(
        f"{p}: no committed checkpoint here; expected a folder holding {MANIFEST}, a checkpoints/ folder, "
        f"or a run folder with committed checkpoints{found}"
    )
