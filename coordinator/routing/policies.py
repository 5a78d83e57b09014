"""Routing policies: pick one healthy instance for a call.

Registry keyed by name; an unknown name fails at start-up listing the
supported ones.
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from typing import Protocol, TypeVar


class Candidate(Protocol):
    """What a policy reads of an instance (routing/pool.py's Instance)."""

    address: str
    inflight: int


Instance = TypeVar("Instance", bound=Candidate)


class Policy(ABC):
    @abstractmethod
    def choose(self, candidates: list[Instance], key: str | None) -> Instance: ...


class LeastLoaded(Policy):
    """Fewest in-flight calls; ties broken round-robin so equal instances share work."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Instance], key: str | None) -> Instance:
        low = min(i.inflight for i in candidates)
        tied = [i for i in candidates if i.inflight == low]
        return tied[next(self._turn) % len(tied)]


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Instance], key: str | None) -> Instance:
        return candidates[next(self._turn) % len(candidates)]


class HashAffinity(Policy):
    """Same key (mm_hash) -> same instance while the healthy set is unchanged (rendezvous hashing)."""

    def __init__(self) -> None:
        self._fallback = LeastLoaded()

    def choose(self, candidates: list[Instance], key: str | None) -> Instance:
        if key is None:
            return self._fallback.choose(candidates, key)
        return max(candidates, key=lambda i: hashlib.sha256(f"{key}|{i.address}".encode()).digest())


POLICIES: dict[str, type[Policy]] = {"least_loaded": LeastLoaded, "round_robin": RoundRobin, "affinity": HashAffinity}


def create_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; supported: {', '.join(sorted(POLICIES))}") from None
