"""Routing policies: which healthy instance gets a request, and why."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.router.config import RouterConfig
from kvtier.router.index import KVIndex, PrefixMatch
from kvtier.router.instances import Instance


class NoInstanceError(RuntimeError):
    """No healthy instance is left to try."""


@dataclass(frozen=True)
class Decision:
    instance: Instance
    # Why: "cache_hit" (the best cached prefix), "saturated" (the instance with the best prefix is
    # saturated), "no_hit" (nothing cached: least loaded), "round_robin", "least_loaded".
    reason: str
    # Prompt tokens the index expects the instance to have cached.
    predicted_cached_tokens: int


class Router:
    def __init__(self, config: RouterConfig, instances: Sequence[Instance],
                 index: KVIndex) -> None:
        self.config = config
        self.instances = list(instances)
        self.index = index
        self._turns = itertools.count()

    def choose(self, block_hashes: Sequence[int], block_size: int,
               exclude: frozenset[str] = frozenset()) -> Decision:
        """The instance for a prompt with these block hashes, never one of `exclude` (URLs
        already tried); raises NoInstanceError when no healthy one is left."""
        candidates = [i for i in self.instances if i.healthy and i.url not in exclude]
        if not candidates:
            raise NoInstanceError("no healthy instance to send the request to")
        policy = self.config.policy
        if policy == "round-robin":
            return Decision(candidates[next(self._turns) % len(candidates)], "round_robin", 0)
        if policy == "least-loaded":
            return Decision(self._least_loaded(candidates), "least_loaded", 0)
        return self._kv_aware(candidates, block_hashes, block_size)

    def _kv_aware(self, candidates: list[Instance], block_hashes: Sequence[int],
                  block_size: int) -> Decision:
        matches = self.matches(block_hashes, candidates)
        open_ = [i for i in candidates if i.load < self.config.saturation] or candidates

        def score(instance: Instance) -> float:
            match = matches.get(instance.slot)
            cached = match.weighted_blocks * block_size if match is not None else 0.0
            return cached - self.config.load_weight_tokens * instance.load

        best = max(open_, key=lambda i: (score(i), -i.load))
        num_blocks = _num_blocks(matches, best)
        if num_blocks:
            reason = "cache_hit"
        elif any(_num_blocks(matches, i) for i in candidates):
            reason = "saturated"
        else:
            best, reason = self._least_loaded(open_), "no_hit"
        return Decision(best, reason, num_blocks * block_size)

    def matches(self, block_hashes: Sequence[int],
                instances: Sequence[Instance]) -> dict[int, PrefixMatch]:
        """Per slot of the indexed `instances`, how much of the prompt the index says it holds."""
        indexed = [i.slot for i in instances if i.indexed]
        return self.index.match(block_hashes, indexed) if block_hashes else {}

    def _least_loaded(self, candidates: list[Instance]) -> Instance:
        # Ties take turns: new conversations arriving one at a time spread over idle instances.
        least = min(i.load for i in candidates)
        tied = [i for i in candidates if i.load == least]
        return tied[next(self._turns) % len(tied)]


def _num_blocks(matches: dict[int, PrefixMatch], instance: Instance) -> int:
    match = matches.get(instance.slot)
    return 0 if match is None else match.num_blocks


