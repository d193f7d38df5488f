"""How a request's KV crosses between instances: one transfer per layer, in one host buffer.

The buffer is layer-major: layer 0's blocks, then layer 1's, ...; within a layer, block after
block, each block its (2, block_size, kv_heads, head_dim) K and V. Layer i of transfer T travels
as transfer `T/i`, so a producer can send a layer as soon as it is computed and a consumer
receives the same transfers whichever way the producer pushed them.
"""

from __future__ import annotations

import torch

from kvtier.transport import BufferId, Region, TransferId


def layer_transfer_id(transfer_id: str, layer_index: int) -> TransferId:
    return TransferId(f"{transfer_id}/{layer_index}")


def split_layer_transfer_id(transfer_id: TransferId) -> tuple[str, int]:
    """(request transfer id, layer index) of a `layer_transfer_id`."""
    request_id, layer = transfer_id.rsplit("/", 1)
    return request_id, int(layer)


class LayerMajorPayload:
    """A host buffer holding `num_blocks` blocks of every layer of `kv_caches`, and the copies
    between it and the paged caches (name -> (2, num_blocks, block_size, kv_heads, head_dim))."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._offsets: list[int] = []
        self._block_shapes: list[torch.Size] = []
        offset = 0
        for cache in kv_caches.values():
            self._offsets.append(offset)
            self._block_shapes.append(cache[:, 0].shape)
            offset += num_blocks * cache[:, 0].nbytes
        self._offsets.append(offset)
        self.buffer = torch.empty(offset, dtype=torch.uint8)

    @property
    def num_layers(self) -> int:
        return len(self._block_shapes)

    def region(self, buffer_id: BufferId, layer_index: int) -> Region:
        start, end = self._offsets[layer_index], self._offsets[layer_index + 1]
        return Region(buffer_id, start, end - start)

    def _blocks(self, layer_index: int, first_block: int, num: int,
                dtype: torch.dtype) -> torch.Tensor:
        start, end = self._offsets[layer_index], self._offsets[layer_index + 1]
        block_bytes = (end - start) // self.num_blocks
        area = self.buffer[start + first_block * block_bytes:start + (first_block + num)
                           * block_bytes]
        return area.view(dtype).view(num, *self._block_shapes[layer_index])  # (n, 2, bs, H, D)

    def copy_out(self, layer_index: int, first_block: int, cache: torch.Tensor,
                 block_ids: list[int]) -> None:
        """Blocks `block_ids` of one layer's paged cache -> this payload's blocks first_block..."""
        if block_ids:
            blocks = self._blocks(layer_index, first_block, len(block_ids), cache.dtype)
            blocks.copy_(cache[:, block_ids].transpose(0, 1))  # (2, n, ...) -> (n, 2, ...)

    def copy_in(self, layer_index: int, first_block: int, cache: torch.Tensor,
                block_ids: list[int]) -> None:
        """This payload's blocks first_block... -> blocks `block_ids` of one layer's cache."""
        if block_ids:
            blocks = self._blocks(layer_index, first_block, len(block_ids), cache.dtype)
            cache[:, block_ids] = blocks.transpose(0, 1).to(cache.device)  # (2, n, bs, H, D)
