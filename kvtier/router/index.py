"""The KV index: block hash -> which instances hold the block, and in which tiers.

One int per block packs every instance's tiers: 4 bits per slot (GPU, CPU, STORAGE, other), slot 0
for shared stores (a block there counts for every instance). The blocks form an LRU bounded by
`max_blocks`: the least recently stored are forgotten first, so the index's memory is bounded
however many instances publish.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.events.schema import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, Locality
from kvtier.router.config import TierWeights

SHARED_SLOT = 0
_BITS_PER_SLOT = 4
_SLOT_MASK = (1 << _BITS_PER_SLOT) - 1
# Tier bit by medium (STORAGE: a disk or file tier of the instance); any other is bit 3.
_TIER_BIT = {MEDIUM_GPU: 0, MEDIUM_CPU: 1, MEDIUM_STORAGE: 2}
_OTHER_BIT = 3


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a prompt's prefix one instance holds."""

    num_blocks: int
    # num_blocks weighted by the best tier each block is in (TierWeights).
    weighted_blocks: float


class KVIndex:
    def __init__(self, max_blocks: int, weights: TierWeights | None = None) -> None:
        weights = weights or TierWeights()
        self.max_blocks = max_blocks
        self.num_evicted = 0
        self._blocks: OrderedDict[int, int] = OrderedDict()
        # Weight of a slot's 4 tier bits, by their value: its best (lowest) tier's weight.
        tiers = (weights.gpu, weights.cpu, weights.disk, weights.remote)
        self._weight_of = [0.0] + [tiers[(bits & -bits).bit_length() - 1]
                                   for bits in range(1, 1 << _BITS_PER_SLOT)]
        self._remote_weight = weights.remote

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, slot: int, block_hashes: Sequence[int], medium: str,
              locality: Locality = "local") -> None:
        bit = _tier_bits(slot, medium, locality)
        blocks = self._blocks
        for block_hash in block_hashes:
            blocks[block_hash] = blocks.get(block_hash, 0) | bit
            blocks.move_to_end(block_hash)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
            self.num_evicted += 1

    def remove(self, slot: int, block_hashes: Sequence[int], medium: str,
               locality: Locality = "local") -> None:
        keep = ~_tier_bits(slot, medium, locality)
        blocks = self._blocks
        for block_hash in block_hashes:
            packed = blocks.get(block_hash)
            if packed is None:
                continue
            packed &= keep
            if packed:
                blocks[block_hash] = packed
            else:
                del blocks[block_hash]

    def clear(self, slot: int, medium: str | None = None) -> None:
        """Forget what `slot` holds: in `medium` only, or everywhere (None). O(index size)."""
        if medium is None:
            keep = ~(_SLOT_MASK << (_BITS_PER_SLOT * slot))
        else:
            keep = ~_tier_bits(slot, medium, "local")
        blocks = self._blocks
        for block_hash, packed in list(blocks.items()):
            packed &= keep
            if packed:
                blocks[block_hash] = packed
            else:
                del blocks[block_hash]

    def match(self, block_hashes: Sequence[int], slots: Sequence[int]) -> dict[int, PrefixMatch]:
        """Per slot, the prompt's leading blocks it holds (or a shared store does)."""
        num = dict.fromkeys(slots, 0)
        weighted = dict.fromkeys(slots, 0.0)
        alive = list(slots)
        weight_of, remote = self._weight_of, self._remote_weight
        for block_hash in block_hashes:
            packed = self._blocks.get(block_hash)
            if packed is None:
                break
            shared = packed & _SLOT_MASK
            still = []
            for slot in alive:
                bits = (packed >> (_BITS_PER_SLOT * slot)) & _SLOT_MASK
                if bits:
                    weighted[slot] += weight_of[bits]
                elif shared:
                    weighted[slot] += remote
                else:
                    continue
                num[slot] += 1
                still.append(slot)
            alive = still
            if not alive:
                break
        return {slot: PrefixMatch(num[slot], weighted[slot]) for slot in slots}


def _tier_bits(slot: int, medium: str, locality: Locality) -> int:
    """The bit of `medium` in `slot`'s nibble; a remote store's copy goes to the shared slot."""
    if locality == "remote":
        slot = SHARED_SLOT
    return 1 << (_BITS_PER_SLOT * slot + _TIER_BIT.get(medium, _OTHER_BIT))
