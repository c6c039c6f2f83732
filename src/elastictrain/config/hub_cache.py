"""Hub model ids (`Qwen/Qwen3-4B-Instruct-2507`) as folders of the local Hugging Face cache, offline.

A model named by id is read from the snapshot the cache holds, as transformers' `local_files_only` does:
`HF_HUB_CACHE`, else `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub`; the id's folder is `models--ORG--NAME`, `refs/REVISION` names the snapshot
(a revision may also be a commit hash). Nothing is downloaded: an id the cache does not hold is an
error naming the id, the folder searched and the command that downloads it. Pure file reads (the
driver checks configs before it imports transformers).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# What the hub accepts as a repository id: NAME or ORG/NAME, letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class HubModelMissing(ValueError):
    """A model id the local cache does not hold (the message says where it looked and what to run)."""


@dataclass(frozen=True)
class Resolved:
    ref: str  # as given
    path: str  # the snapshot folder
    revision: str
    commit: str

    def line(self, field: str) -> str:
        return (
            f"{field} {self.ref!r}: from the Hugging Face cache, snapshot {self.commit[:12]} "
            f"(revision {self.revision}): {self.path}"
        )


def hub_cache_dir() -> Path:
    """The folder the cache lives in, from the same variables huggingface_hub reads."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def looks_like_hub_id(value: str) -> bool:
    """An id rather than a path: ORG/NAME (or NAME) with no leading '/', '.', '~'."""
    return bool(_HUB_ID.match(value)) and not value.startswith((".", "~"))


def resolve_model(ref: str, field: str, revision: str = "main", cache: str | None = None) -> Resolved | None:
    """None where `ref` is a local folder (or cannot be an id); the snapshot where it is a cached id.

    `cache`: the cache folder to search instead of hub_cache_dir(). Raises HubModelMissing where `ref` is
    an id the cache does not hold (or holds without config.json).
    """
    if Path(ref).expanduser().is_dir() or not looks_like_hub_id(ref):
        return None
    cache_dir = Path(cache).expanduser() if cache else hub_cache_dir()
    repo = cache_dir / ("models--" + ref.replace("/", "--"))
    ref_file = repo / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        held = sorted(p.name for p in (repo / "snapshots").glob("*")) if repo.is_dir() else []
        found = (
            f"it holds snapshots {', '.join(held)} but none for revision {revision!r}" if held else "absent"
        )
        raise HubModelMissing(
            f"{field}: got {ref!r}; neither a local folder nor in the Hugging Face cache ({cache_dir}: "
            f"{repo.name} {found}). Nothing is downloaded at train time: download it once with "
            f"`hf download {ref}`"
            + (f" --revision {revision}" if revision != "main" else "")
            + " (huggingface_hub's CLI; HF_HOME or HF_HUB_CACHE choose the cache), or give a local folder"
        )
    if not (snapshot / "config.json").is_file() and not (snapshot / "adapter_config.json").is_file():
        raise HubModelMissing(
            f"{field}: got {ref!r}; its cached snapshot {snapshot} holds no config.json (an incomplete "
            f"download?); run `hf download {ref}` again"
        )
    return Resolved(ref, str(snapshot), revision, commit)
