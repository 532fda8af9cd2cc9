"""Registries from names to implementations: policies, schemes, protocols.

A `Registry[T]` maps a configured name to what implements it. `register(name)` is a class or function
decorator; `get(name)` returns the entry or raises a one-line `ValueError` naming the config key, the closest
known name ("did you mean") and every allowed name. `unknown_name_message` is that line, for checks that look
names up elsewhere (model files, Hydra groups).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def unknown_name_message(key: str, name: object, known: list[str]) -> str:
    """One line for an unknown name: the key, the close match, and everything allowed."""
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}: unknown {name!r}{hint}; allowed: {', '.join(known)}"


class Registry(Generic[T]):
    """Names -> entries of one kind, in registration order; `key` is the config key named in errors."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(unknown_name_message(self.key, name, self.names()))
        return self._entries[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
