"""The base of ncm's state enums: a member is its string value wherever it is shown (JSON,
logs, messages, metric labels), so views and events read the same as plain strings."""

from __future__ import annotations

from enum import Enum


class StateEnum(str, Enum):
    """A state whose members compare equal to, print and format as their values."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
