"""Bounded memos keyed by an object's identity, for values the search works out again and again
from one immutable object (a ``ModelSpec``, a tuple of tensor sizes) and a few small key parts."""

from __future__ import annotations

from typing import Any, Hashable


class IdentityMemo:
    """Values computed from an immutable ``owner`` and a hashable ``key``, found by the owner's
    identity: hashing a ModelSpec reads every field, which took longer than most of the values
    (6 us a call for Llama-2-7b). The owner is kept beside its value, so no other object takes its
    id while the entry lives; past ``kept`` entries the memo starts again, so a long-running
    service that sees many models stays bounded."""

    __slots__ = ("_entries", "_kept")

    def __init__(self, *, kept: int) -> None:
        self._entries: dict[tuple[int, Hashable], tuple[Any, Any]] = {}
        self._kept = kept

    def get(self, owner: Any, key: Hashable = None) -> Any:
        """The value remembered for ``owner`` and ``key``, or None."""
        hit = self._entries.get((id(owner), key))
        return hit[1] if hit is not None and hit[0] is owner else None

    def put(self, owner: Any, key: Hashable, value: Any) -> Any:
        """Remember ``value`` for ``owner`` and ``key``; returns it."""
        if len(self._entries) >= self._kept:
            self._entries.clear()
        self._entries[id(owner), key] = (owner, value)
        return value


__all__ = ["IdentityMemo"]
