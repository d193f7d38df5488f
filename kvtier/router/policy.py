"""Routing policies: which healthy instance gets a request, and why.

kv-aware routing estimates, for each instance, the prompt tokens it would compute before this
request's first token: the prefill work already waiting there, a fixed share per request of
load, and this prompt less what that instance has cached (each cached block weighted by its tier,
so a copy on a slower tier saves less). The cheapest instance wins: a conversation stays where
its prefix is cached until the queue there costs more than recomputing the prefix elsewhere, or
the instance saturates.
"""

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
    # Why: "cache_hit" (the best cached prefix), "saturated" (the instance with the best prefix
    # is saturated), "busy" (the queue at the instance with the best prefix costs more than
    # recomputing it here), "no_hit" (nothing cached: the least work waiting), "round_robin",
    # "least_loaded".
    reason: str
    # Prompt tokens the index expects the instance to have cached.
    predicted_cached_tokens: int
    # Prompt tokens the instance is expected to compute for this request (tier-weighted: a
    # block loaded from a slower tier counts for part of its recompute); 0 outside kv-aware.
    prefill_tokens: int = 0


class Router:
    def __init__(self, config: RouterConfig, instances: Sequence[Instance],
                 index: KVIndex) -> None:
        self.config = config
        self.instances = list(instances)
        self.index = index
        self._turns = itertools.count()

    def choose(self, block_hashes: Sequence[int], block_size: int,
               exclude: frozenset[str] = frozenset(),
               num_prompt_tokens: int | None = None) -> Decision:
        """The instance for a prompt with these block hashes (and `num_prompt_tokens` tokens;
        None: its full blocks), never one of `exclude` (URLs already tried); raises
        NoInstanceError when no healthy one is left."""
        candidates = [i for i in self.instances if i.healthy and i.url not in exclude]
        if not candidates:
            raise NoInstanceError("no healthy instance to send the request to")
        policy = self.config.policy
        if policy == "round-robin":
            return Decision(candidates[next(self._turns) % len(candidates)], "round_robin", 0)
        if policy == "least-loaded":
            return Decision(self._least_loaded(candidates), "least_loaded", 0)
        if num_prompt_tokens is None:
            num_prompt_tokens = len(block_hashes) * block_size
        return self._kv_aware(candidates, block_hashes, block_size, num_prompt_tokens)

    def _kv_aware(self, candidates: list[Instance], block_hashes: Sequence[int],
                  block_size: int, num_prompt_tokens: int) -> Decision:
        matches = self.matches(block_hashes, candidates)
        open_ = [i for i in candidates if i.load < self.config.saturation] or candidates
        costs = {i.slot: self.cost(i, matches.get(i.slot), num_prompt_tokens, block_size)
                 for i in open_}
        cheapest = min(costs.values())
        # Ties take turns: new conversations arriving at idle instances spread over them. Only
        # ties count a turn: had every decision counted, conversations of as many turns as
        # there are instances would all start on the same one.
        tied = [i for i in open_ if costs[i.slot] == cheapest]
        best = tied[next(self._turns) % len(tied)] if len(tied) > 1 else tied[0]
        cached = _weighted_blocks(matches, best)
        holder = max(candidates, key=lambda i: _weighted_blocks(matches, i))
        if _weighted_blocks(matches, holder) == 0.0:
            reason = "no_hit"
        elif cached >= _weighted_blocks(matches, holder):
            reason = "cache_hit"
        else:
            reason = "busy" if holder in open_ else "saturated"
        prefill = _prefill_tokens(num_prompt_tokens, cached, block_size)
        return Decision(best, reason, _num_blocks(matches, best) * block_size, round(prefill))

    def cost(self, instance: Instance, match: PrefixMatch | None, num_prompt_tokens: int,
             block_size: int) -> float:
        """Prompt tokens `instance` would compute before this request's first token: the
        prefill waiting there, `load_weight_tokens` a request of load (decode steps, other
        clients' prompts), and this prompt's part it has not cached."""
        cached = 0.0 if match is None else match.weighted_blocks
        return (instance.queued_tokens + self.config.load_weight_tokens * instance.load
                + _prefill_tokens(num_prompt_tokens, cached, block_size))

    def matches(self, block_hashes: Sequence[int],
                instances: Sequence[Instance]) -> dict[int, PrefixMatch]:
        """Per slot of the indexed `instances`, how much of the prompt the index says it holds."""
        indexed = [i.slot for i in instances if i.indexed]
        return self.index.match(block_hashes, indexed) if block_hashes else {}

    def _least_loaded(self, candidates: list[Instance]) -> Instance:
        # Ties take turns, as in kv-aware routing.
        least = min(i.load for i in candidates)
        tied = [i for i in candidates if i.load == least]
        return tied[next(self._turns) % len(tied)]


def _prefill_tokens(num_prompt_tokens: int, weighted_blocks: float, block_size: int) -> float:
    return max(num_prompt_tokens - weighted_blocks * block_size, 0.0)


def _num_blocks(matches: dict[int, PrefixMatch], instance: Instance) -> int:
    match = matches.get(instance.slot)
    return 0 if match is None else match.num_blocks


def _weighted_blocks(matches: dict[int, PrefixMatch], instance: Instance) -> float:
    match = matches.get(instance.slot)
    return 0.0 if match is None else match.weighted_blocks
