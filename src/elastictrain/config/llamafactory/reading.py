"""One LLaMA-Factory file being read: the keys given, what they become, and what was said about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOT_GIVEN = object()


@dataclass
class Reading:
    """The file's keys (overrides applied), the elastictrain keys they become, notices and problems."""

    given: dict[str, Any]
    cwd: Path  # LLaMA-Factory resolves output_dir, dataset_dir and deepspeed against it
    defaults: dict[str, Any] = field(default_factory=dict)  # LLaMA-Factory's, by key (keys.py)
    native: dict[str, Any] = field(default_factory=dict)  # dotted elastictrain key -> value
    notices: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    world_size: int = 1  # the world size the run starts at (translate.py)
    model_path: str | None = None  # model_name_or_path, resolved to a folder

    def get(self, name: str) -> Any:
        """The key's value as given, else LLaMA-Factory's default for it."""
        if name in self.given:
            return self.given[name]
        return self.defaults.get(name)

    def was_given(self, name: str) -> bool:
        return name in self.given

    def set(self, key: str, value: Any) -> None:
        self.native[key] = value

    def path(self, value: str) -> str:
        """A path of the file, made absolute against the working directory as LLaMA-Factory does (an
        object-store URL, which elastictrain's run.dir may be, stays as it is)."""
        from elastictrain.storage.objects import is_url

        if is_url(str(value)):
            return str(value)
        p = Path(str(value)).expanduser()
        return str(p if p.is_absolute() else (self.cwd / p).resolve())

    def refuse(self, name: str, why: str) -> None:
        self.problems.append(f"{name}: got {self.get(name)!r}; {why}")

    def note(self, text: str) -> None:
        self.notices.append(text)


def comma_list(value: Any) -> list[str]:
    """LLaMA-Factory's "a,b" (or a YAML list) as names."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    return [str(x).strip() for x in items if str(x).strip()]
