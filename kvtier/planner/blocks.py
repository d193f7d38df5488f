"""Block identities of trace prompts, without token ids.

A replay (kvtier bench trace) gives every hash id its own fixed tokens, so two prompts share an
engine block exactly when they share the hash ids up to it and its offset within the hash id's
tokens. Each block is therefore named by (its parent block, hash id, offset), interned to a
small BlockHash: a chain like the engine's token hashes, at a dictionary lookup per block.
"""

from __future__ import annotations

from kvtier.kv.hashing import BlockHash


class BlockKeys:
    """Chained block identities of prompts whose hash ids stand for `tokens_per_block` tokens,
    in engine blocks of `block_size` tokens."""

    def __init__(self, tokens_per_block: int, block_size: int) -> None:
        if tokens_per_block % block_size:
            raise ValueError(f"tokens per hash id ({tokens_per_block}) must be a multiple of the "
                             f"engine's block size ({block_size}); pick --tokens-per-block or "
                             "--block-size to fit")
        self.block_size = block_size
        self._blocks_per_id = tokens_per_block // block_size
        # (parent node, hash id) -> the nodes of that hash id's blocks; node n's BlockHash is
        # _hashes[n - 1]. Keyed per hash id, not per block: one lookup covers all its blocks.
        self._children: dict[tuple[int, int], list[int]] = {}
        self._hashes: list[BlockHash] = []

    @property
    def num_distinct(self) -> int:
        """Distinct full blocks seen so far, over every prompt asked about."""
        return len(self._hashes)

    def prompt_keys(self, hash_ids: tuple[int, ...], num_prompt_tokens: int) -> list[BlockHash]:
        """The BlockHash of each full block of the prompt, in order."""
        num_blocks = num_prompt_tokens // self.block_size
        nodes: list[int] = []
        parent = 0
        for position in range(-(-num_blocks // self._blocks_per_id)):
            wanted = min(self._blocks_per_id, num_blocks - position * self._blocks_per_id)
            children = self._children.setdefault((parent, hash_ids[position]), [])
            # A partial last hash id holds a prefix of the blocks a full one would.
            while len(children) < wanted:
                self._hashes.append(BlockHash(len(self._hashes).to_bytes(8, "little")))
                children.append(len(self._hashes))
            nodes.extend(children[:wanted])
            parent = children[-1] if wanted == self._blocks_per_id else -1
        hashes = self._hashes
        return [hashes[node - 1] for node in nodes]
