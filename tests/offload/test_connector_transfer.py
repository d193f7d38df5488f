"""The worker's chunk copies on real tensors: the standard page layout, byte for byte."""

import numpy as np
import pytest
import torch

from kvtier.connector.offloading import transfer as transfer_module
from kvtier.connector.offloading.metadata import ChunkTransfer
from kvtier.connector.offloading.transfer import ChunkCopier
from kvtier.models import cpu_kernels
from kvtier.offload.host_area import HostArea
from kvtier.offload.layout import ChunkLayout
from kvtier.offload.tiers.base import MappedChunk
from kvtier.offload.tiers.slot_file import MappedFile

NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, LAYERS, PER_CHUNK = 6, 4, 2, 3, 2, 2


def _transfer(slot, offsets, block_ids):
    return ChunkTransfer(0, "req", 0, slot, tuple(offsets), tuple(block_ids))


def _setup(dtype=torch.float32, use_numpy=None, use_kernel=None, head_dim=HEAD_DIM):
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, head_dim).to(dtype) for _ in range(LAYERS)]
    layout = ChunkLayout.for_attention(BLOCK, HEADS, head_dim, caches[0].element_size(), LAYERS,
                                       PER_CHUNK)
    area = HostArea(3 * layout.chunk_bytes, layout.chunk_bytes)
    copier = ChunkCopier(area.buffer, area.slot_bytes, [caches], [layout], use_numpy=use_numpy,
                         use_kernel=use_kernel)
    return caches, layout, area, copier


@pytest.mark.parametrize("use_numpy", [True, False])
def test_device_to_host_writes_the_standard_layout(use_numpy):
    caches, layout, area, copier = _setup(use_numpy=use_numpy)
    assert copier.device_to_host([_transfer(1, [0, 1], [4, 2])]) == 2 * layout.block_bytes
    slot = area.slot_array(1)
    for offset, block_id in enumerate([4, 2]):
        for layer in range(LAYERS):
            start = layout.page_offset(offset, layer)
            page = slot[start:start + layout.page_bytes].view(np.float32)
            # one page: K then V, each (block_size, kv_heads, head_dim) contiguous
            expected = caches[layer][:, block_id].numpy().reshape(-1)
            assert np.array_equal(page, expected)
    assert not area.buffer[:layout.chunk_bytes].any()  # other slots untouched


@pytest.mark.parametrize("use_numpy", [True, False])
def test_round_trip_into_other_block_ids_is_byte_exact(use_numpy):
    for dtype in (torch.float32, torch.bfloat16):
        caches, layout, area, copier = _setup(dtype, use_numpy)
        before = [cache.clone() for cache in caches]
        copier.device_to_host([_transfer(2, [0, 1], [1, 3])])
        assert copier.host_to_device([_transfer(2, [1], [5])]) == layout.block_bytes
        for layer in range(LAYERS):
            assert torch.equal(caches[layer][:, 5], before[layer][:, 3])
            assert torch.equal(caches[layer][:, :5], before[layer][:, :5])


@pytest.mark.parametrize("use_numpy", [True, False])
def test_one_batch_copies_blocks_of_several_chunks(use_numpy):
    caches, layout, area, copier = _setup(use_numpy=use_numpy)
    before = [cache.clone() for cache in caches]
    copier.device_to_host([_transfer(0, [0, 1], [1, 2]), _transfer(2, [1], [3])])
    copier.host_to_device([_transfer(2, [1], [4]), _transfer(0, [0, 1], [5, 1])])
    for layer in range(LAYERS):
        assert torch.equal(caches[layer][:, 4], before[layer][:, 3])
        assert torch.equal(caches[layer][:, 5], before[layer][:, 1])
        assert torch.equal(caches[layer][:, 1], before[layer][:, 2])


@pytest.mark.skipif(cpu_kernels.ops() is None, reason="the C++ CPU kernels are not built")
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 32])
def test_the_load_kernel_writes_what_numpy_writes(head_dim):
    """48-byte parts are copied with memcpy; 512-byte ones (whole 64-byte lines) with streaming
    stores where the CPU has AVX-512."""
    torch.manual_seed(6)
    kernel_caches, layout, area, kernel = _setup(torch.bfloat16, use_kernel=True,
                                                 head_dim=head_dim)
    assert kernel.page_loaders == [cpu_kernels.ops().load_pages]
    numpy_caches = [cache.clone() for cache in kernel_caches]
    plain = ChunkCopier(area.buffer, area.slot_bytes, [numpy_caches], [layout], use_kernel=False)
    area.buffer[:] = np.random.default_rng(6).integers(0, 256, len(area.buffer), dtype=np.uint8)
    # Scattered blocks, one run of two, slots out of order.
    transfers = [_transfer(2, [1, 0], [5, 0]), _transfer(0, [0, 1], [2, 3]), _transfer(1, [1], [1])]
    assert kernel.host_to_device(transfers) == plain.host_to_device(transfers)
    for ours, reference in zip(kernel_caches, numpy_caches, strict=True):
        assert torch.equal(ours.view(torch.int16), reference.view(torch.int16))
    assert not torch.equal(kernel_caches[0][:, 4], kernel_caches[0][:, 5])  # 4 is untouched


def test_numpy_and_torch_paths_write_the_same_bytes():
    torch.manual_seed(3)
    caches, layout, area, fast = _setup(torch.bfloat16, use_numpy=True)
    reference_area = HostArea(3 * layout.chunk_bytes, layout.chunk_bytes)
    reference = ChunkCopier(reference_area.buffer, reference_area.slot_bytes, [caches],
                            [layout], use_numpy=False)
    transfers = [_transfer(2, [1, 0], [5, 3]), _transfer(0, [1], [2])]
    fast.device_to_host(transfers)
    reference.device_to_host(transfers)
    assert np.array_equal(area.buffer, reference_area.buffer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_match_the_cpu_layout():
    torch.manual_seed(4)
    cpu_caches, layout, cpu_area, cpu_copier = _setup(torch.bfloat16)
    gpu_caches = [cache.cuda() for cache in cpu_caches]
    gpu_area = HostArea(3 * layout.chunk_bytes, layout.chunk_bytes)
    gpu_copier = ChunkCopier(gpu_area.buffer, gpu_area.slot_bytes, [gpu_caches], [layout])
    transfers = [_transfer(1, [0, 1], [4, 2])]
    cpu_copier.device_to_host(transfers)
    gpu_copier.device_to_host(transfers, gpu_copier.record_compute())
    assert np.array_equal(cpu_area.buffer, gpu_area.buffer)
    gpu_copier.host_to_device([_transfer(1, [1], [5])])
    assert torch.equal(gpu_caches[0][:, 5].cpu(), cpu_caches[0][:, 2])


@pytest.mark.parametrize("use_numpy", [True, False])
def test_runs_across_slots_and_broken_runs_copy_each_block_once(use_numpy):
    caches, layout, area, copier = _setup(use_numpy=use_numpy)
    before = [cache.clone() for cache in caches]
    # Blocks 1..4 on consecutive host pages of slots 0 and 1 (one run), then 5 out of order.
    transfers = [_transfer(0, [0, 1], [1, 2]), _transfer(1, [0, 1], [3, 4]),
                 _transfer(2, [1], [5])]
    assert copier.device_to_host(transfers) == 5 * layout.block_bytes
    for slot, offset, block_id in [(0, 0, 1), (0, 1, 2), (1, 0, 3), (1, 1, 4), (2, 1, 5)]:
        for layer in range(LAYERS):
            start = slot * area.slot_bytes + layout.page_offset(offset, layer)
            page = area.buffer[start:start + layout.page_bytes].view(np.float32)
            assert np.array_equal(page, before[layer][:, block_id].numpy().reshape(-1))
    # Back in reverse: host pages of blocks 1..4 land on device blocks 4, 3, 2, 1.
    copier.host_to_device([_transfer(0, [0, 1], [4, 3]), _transfer(1, [0, 1], [2, 1])])
    for layer in range(LAYERS):
        for source, target in [(1, 4), (2, 3), (3, 2), (4, 1)]:
            assert torch.equal(caches[layer][:, target], before[layer][:, source])


def test_torch_path_splits_large_gathers_into_bounded_batches(monkeypatch):
    torch.manual_seed(5)
    caches, layout, area, reference = _setup(torch.bfloat16, use_numpy=True)
    split_area = HostArea(3 * layout.chunk_bytes, layout.chunk_bytes)
    split = ChunkCopier(split_area.buffer, split_area.slot_bytes, [caches], [layout],
                        use_numpy=False)
    monkeypatch.setattr(transfer_module, "_GATHER_BYTES", layout.block_bytes)  # one block each
    transfers = [_transfer(0, [0, 1], [1, 2]), _transfer(1, [0, 1], [3, 4])]
    reference.device_to_host(transfers)
    split.device_to_host(transfers)
    assert np.array_equal(area.buffer, split_area.buffer)
    before = [cache.clone() for cache in caches]
    split.host_to_device([_transfer(0, [0, 1], [5, 3])])
    for layer in range(LAYERS):
        assert torch.equal(caches[layer][:, 5], before[layer][:, 1])
        assert torch.equal(caches[layer][:, 3], before[layer][:, 2])


@pytest.mark.parametrize("use_numpy", [True, False])
def test_state_pages_of_a_second_group_round_trip_in_one_piece(use_numpy):
    """A recurrent-state group beside an attention group: caches (1, num_blocks, 2, 5), one
    block per chunk; its page is the state's bytes as they lie."""
    caches, layout, _, _ = _setup()
    states = [torch.randn(1, NUM_BLOCKS, 2, 5) for _ in range(3)]
    state_layout = ChunkLayout(page_bytes=2 * 5 * 4, num_layers=3, blocks_per_chunk=1)
    area = HostArea(3 * layout.chunk_bytes, layout.chunk_bytes)
    copier = ChunkCopier(area.buffer, area.slot_bytes, [caches, states], [layout, state_layout],
                         use_numpy=use_numpy)
    before = [state.clone() for state in states]
    store = ChunkTransfer(0, "req", 1, 1, (0,), (4,))
    assert copier.device_to_host([store]) == state_layout.block_bytes
    slot = area.slot_array(1)
    for layer in range(3):
        start = state_layout.page_offset(0, layer)
        page = slot[start:start + state_layout.page_bytes].view(np.float32)
        assert np.array_equal(page, before[layer][0, 4].numpy().reshape(-1))
    copier.host_to_device([ChunkTransfer(1, "req", 1, 1, (0,), (2,))])
    for layer in range(3):
        assert torch.equal(states[layer][0, 2], before[layer][0, 4])
        assert torch.equal(states[layer][0, :2], before[layer][0, :2])


@pytest.mark.parametrize("path", ["kernel", "numpy", "torch"])
def test_loads_from_a_mapped_file_write_what_host_loads_write(tmp_path, path):
    """A load straight from a tier's mapped file (MappedChunk) and one from a host slot holding
    the same bytes fill the blocks alike, in the same call."""
    if path == "kernel" and cpu_kernels.ops() is None:
        pytest.skip("the C++ CPU kernels are not built")
    caches, layout, area, copier = _setup(torch.bfloat16, use_numpy=path != "torch",
                                          use_kernel={"kernel": True}.get(path, False))
    copier.device_to_host([_transfer(0, [0, 1], [1, 2])])
    path_of_file = tmp_path / "slots"
    path_of_file.write_bytes(bytes(4096) + area.slot_array(0)[:layout.chunk_bytes].tobytes())
    with open(path_of_file, "rb") as f:
        mapping = MappedFile.open(f.fileno(), 4096 + layout.chunk_bytes)
    if mapping is None:
        pytest.skip("no file mapping with residency checks here")
    mapped = MappedChunk(None, mapping, 4096, layout.chunk_bytes, 0)
    before = [cache.clone() for cache in caches]
    loads = [ChunkTransfer(1, "req", 0, None, (0, 1), (4, 5), mapped), _transfer(0, [1], [3])]
    assert copier.host_to_device(loads) == 3 * layout.block_bytes
    for layer in range(LAYERS):
        assert torch.equal(caches[layer][:, 4], before[layer][:, 1])
        assert torch.equal(caches[layer][:, 5], before[layer][:, 2])
        assert torch.equal(caches[layer][:, 3], before[layer][:, 2])
