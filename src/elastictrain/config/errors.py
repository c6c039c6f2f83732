"""Configuration errors that name the field, the bad value and what would be valid."""

from __future__ import annotations


class ConfigError(ValueError):
    """One or more problems, one line each: `field.path: got X; expected Y`."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))
