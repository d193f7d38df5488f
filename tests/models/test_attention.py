"""The fast paged attention equals the plain reference, with the C++ kernels and with the
pure-torch path; write_kv fills exactly the mapped slots; the connector layer hooks run in
order around each layer."""

import shutil

import pytest
import torch

from kvtier.models import (
    attention,
    build_attention_metadata,
    cpu_kernels,
    paged_attention,
    reference_paged_attention,
    write_kv,
)

from .helpers import PagedDriver, scattered_decodes

BLOCK = 4
NUM_BLOCKS = 40
HEAD_DIM = 8


@pytest.fixture(params=["amx", "vdpbf16ps"])
def bf16_tiles(request):
    """The bf16 kernel tests run on both tile kinds: AMX tile multiplies where the CPU and the
    OS allow them, then the vdpbf16ps tiles on the same CPU."""
    kernels = cpu_kernels.ops()
    if kernels is None:
        pytest.skip("no C++ kernels: no bf16 tiles")
    uses_amx = kernels.use_amx_tiles(request.param == "amx")
    try:
        if request.param == "amx" and not uses_amx:
            pytest.skip("no AMX tiles on this CPU")
        yield request.param
    finally:
        kernels.use_amx_tiles(True)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: torch path only")
def test_cpu_kernels_build_where_a_compiler_exists():
    """A kernel that silently failed to build would cost a third of the decode speed."""
    kernels = cpu_kernels.ops()
    assert kernels is not None
    assert kernels.paged_decode_attention is not None
    assert kernels.paged_prefill_attention is not None


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decodes_match_fp32_reference(dtype):
    """The kernel converts each row to fp32 and accumulates in fp32; only rounding differs."""
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK, 3, 64, generator=gen)
    tables = [[7, 3, 29, 14, 1, 2, 5], [22], [31, 9, 36, 8, 15]]
    metadata = build_attention_metadata([25, 2, 17], [1, 1, 1], [tables], BLOCK)
    query = torch.randn(3, 9, 64, generator=gen)
    reference = reference_paged_attention(query.to(dtype).float(), kv_cache.to(dtype).float(),
                                          metadata, 0, 0.125, None)
    out = paged_attention(query.to(dtype), kv_cache.to(dtype), metadata, 0, 0.125, None)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("attention_path", "bf16_tiles")
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (16, 2), (32, 8), (24, 2)])
def test_bf16_decodes_on_16_slot_pages_match_fp32_reference(num_heads, num_kv_heads, head_dim,
                                                            window):
    """bf16 with 16-slot pages takes the kernel's AMX or vdpbf16ps path where the CPU has them:
    sequences ending inside a page, on its last slot and just past it, a window starting inside
    a page; groups of 3, 8 (AMX's most) and 12 query heads per kv head; 32 query heads, more
    than one AMX score tile holds."""
    gen = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(2, 64, 16, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    seq_lens = [1, 16, 17, 100, 37, 300]  # 300: more pages than AMX sums between tile stores
    metadata = scattered_decodes(seq_lens, 64, 16, gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    reference = reference_paged_attention(query.float(), kv_cache.float(), metadata, 0, scale,
                                          window)
    out = paged_attention(query, kv_cache, metadata, 0, scale, window)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


def _scenario(num_heads: int, num_kv_heads: int):
    """A mixed step: two decodes, a fresh prefill and a prefill chunk over a cached prefix."""
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK, num_kv_heads, HEAD_DIM, generator=gen)
    num_computed = [10, 0, 7, 21]
    query_lens = [1, 6, 5, 1]
    # Non-contiguous, out-of-order block ids; seq 3 ends exactly on a block boundary + 2.
    tables = [[33, 5, 17], [9, 2], [30, 11, 25], [4, 38, 12, 27, 6, 19]]
    metadata = build_attention_metadata(num_computed, query_lens, [tables], BLOCK)
    query = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=gen)
    return query, kv_cache, metadata


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("window", [None, 3, 5, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_fast_attention_equals_reference(window, num_heads, num_kv_heads):
    query, kv_cache, metadata = _scenario(num_heads, num_kv_heads)
    fast = paged_attention(query, kv_cache, metadata, 0, 0.3, window)
    reference = reference_paged_attention(query, kv_cache, metadata, 0, 0.3, window)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("window", [None, 6])
def test_decode_only_batch_equals_reference(window):
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK, 2, HEAD_DIM, generator=gen)
    tables = [[7, 3, 29, 14], [22], [31, 9, 36, 8, 15]]
    metadata = build_attention_metadata([13, 2, 17], [1, 1, 1], [tables], BLOCK)
    assert metadata.is_decode_only
    query = torch.randn(3, 4, HEAD_DIM, generator=gen)
    fast = paged_attention(query, kv_cache, metadata, 0, 0.5, window)
    reference = reference_paged_attention(query, kv_cache, metadata, 0, 0.5, window)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (3, 3)])
def test_equal_length_decodes_on_a_block_boundary_equal_reference(num_heads, num_kv_heads):
    """Every gathered key is attended, so the fast path runs without a mask."""
    gen = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK, num_kv_heads, HEAD_DIM, generator=gen)
    tables = [[7, 3], [22, 5], [31, 9]]
    metadata = build_attention_metadata([7, 7, 7], [1, 1, 1], [tables], BLOCK)
    query = torch.randn(3, num_heads, HEAD_DIM, generator=gen)
    fast = paged_attention(query, kv_cache, metadata, 0, 0.5, None)
    reference = reference_paged_attention(query, kv_cache, metadata, 0, 0.5, None)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("attention_path")
def test_window_skips_blocks_before_it():
    """Blocks wholly before the window are never read, so they may be the null block (here
    poisoned with NaN) as the sliding-window manager leaves them."""
    query, kv_cache, metadata = _scenario(4, 2)
    reference = reference_paged_attention(query, kv_cache, metadata, 0, 0.3, 3)
    kv_cache[:, 33] = float("nan")  # seq 0's first block: positions 0-3; its query is at 10
    kv_cache[:, 4] = float("nan")  # seq 3's first block: positions 0-3; its query is at 21
    out = paged_attention(query, kv_cache, metadata, 0, 0.3, 3)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def _long_prefill_scenario(head_dim: int, dtype: torch.dtype = torch.float32):
    """Block size 16 with head dim 64 or 128 (the kernels' vectorised cases), GQA 3:1: chunks
    over long cached prefixes longer than one 32-token kernel tile, a fresh prompt, a decode."""
    gen = torch.Generator().manual_seed(4)
    block = 16
    num_computed = [70, 0, 33, 100]
    query_lens = [45, 37, 1, 3]
    order = torch.randperm(63, generator=gen) + 1  # block 0 stays the null block
    tables, used = [], 0
    for computed, length in zip(num_computed, query_lens):
        count = -(-(computed + length) // block)
        tables.append(order[used:used + count].tolist())
        used += count
    kv_cache = torch.randn(2, 64, block, 3, head_dim, generator=gen).to(dtype)
    metadata = build_attention_metadata(num_computed, query_lens, [tables], block)
    query = torch.randn(sum(query_lens), 9, head_dim, generator=gen).to(dtype)
    return query, kv_cache, metadata, tables


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_chunks_over_cached_prefixes_equal_reference(head_dim, window):
    query, kv_cache, metadata, tables = _long_prefill_scenario(head_dim)
    reference = reference_paged_attention(query, kv_cache, metadata, 0, head_dim ** -0.5, window)
    if window is not None:  # seq 0's queries start at 70: keys before 31 are outside the window
        kv_cache[:, tables[0][0]] = float("nan")
    fast = paged_attention(query, kv_cache, metadata, 0, head_dim ** -0.5, window)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_prefills_match_fp32_reference(dtype, head_dim, window):
    """bf16 takes the kernel's vdpbf16ps path where the CPU has AVX512-BF16."""
    query, kv_cache, metadata, tables = _long_prefill_scenario(head_dim, dtype)
    scale = head_dim ** -0.5
    reference = reference_paged_attention(query.float(), kv_cache.float(), metadata, 0, scale,
                                          window)
    if window is not None:  # never read: outside every query's window
        kv_cache[:, tables[0][0]] = float("nan")
    out = paged_attention(query, kv_cache, metadata, 0, scale, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


def test_long_prefills_take_the_flash_path_beside_kernel_prefills(monkeypatch):
    """Past the kernel's query limit a prefill goes to scaled_dot_product_attention; both kinds
    and a decode share one step and each fills only its own rows."""
    monkeypatch.setattr(attention, "KERNEL_PREFILL_MAX_QUERIES", 40)
    query, kv_cache, metadata, _ = _long_prefill_scenario(64)
    plan = attention._group_plan(metadata, 0, None, kv_cache, kv_cache.dtype)
    if plan.kernel_prefill is not None:  # with the kernels: seqs 1 and 3 there, seq 0 not
        assert plan.kernel_prefill.query_lens.tolist() == [37, 3]
    assert [p.query_end - p.query_start for p in plan.prefills] == (
        [45] if plan.kernel_prefill is not None else [45, 37, 3])
    fast = paged_attention(query, kv_cache, metadata, 0, 0.125, None)
    reference = reference_paged_attention(query, kv_cache, metadata, 0, 0.125, None)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block,head_dim,dtype", [
    (8, 64, torch.float32), (32, 64, torch.float32), (16, 96, torch.float32),
    (4, 16, torch.float32), (16, 96, torch.bfloat16), (4, 16, torch.bfloat16)])
def test_prefills_of_shapes_the_kernel_is_not_vectorised_for_take_the_torch_path(block, head_dim,
                                                                                dtype):
    """Outside its bf16 tiles the prefill kernel takes head dim 64 or 128 with 16-token blocks;
    other caches' prefills (at any length) go to scaled_dot_product_attention, where a generic
    loop ran 4-10x slower, while their decodes stay in the decode kernel. The kernel itself
    refuses them by name."""
    kernels = cpu_kernels.ops()
    if kernels is None:
        pytest.skip("no C++ kernels")
    gen = torch.Generator().manual_seed(6)
    num_computed, query_lens = [0, 40, 9], [12, 3, 1]
    counts = [-(-(c + q) // block) for c, q in zip(num_computed, query_lens)]
    order = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    tables = [order[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
    kv_cache = torch.randn(2, sum(counts) + 1, block, 2, head_dim, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), 4, head_dim, generator=gen).to(dtype)
    metadata = build_attention_metadata(num_computed, query_lens, [tables], block)
    plan = attention._group_plan(metadata, 0, None, kv_cache, kv_cache.dtype)
    assert plan.kernel_prefill is None
    assert [p.query_end - p.query_start for p in plan.prefills] == [12, 3]
    assert isinstance(plan.decode, attention._KernelDecodePlan)
    scale = head_dim ** -0.5
    out = paged_attention(query, kv_cache, metadata, 0, scale, None)
    reference = reference_paged_attention(query.float(), kv_cache.float(), metadata, 0, scale,
                                          None)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)
    with pytest.raises(RuntimeError, match="takes head_dim 64 or 128 with 16-slot blocks"):
        kernels.paged_prefill_attention(
            query, kv_cache, torch.tensor(tables[:1]), torch.tensor([0]), torch.tensor([0]),
            torch.tensor([12]), 0, scale, torch.empty_like(query))


@pytest.mark.usefixtures("bf16_tiles")
def test_bf16_prefills_of_any_length_stay_in_the_kernel_where_it_has_bf16_tiles(monkeypatch):
    """The vdpbf16ps tiles beat the flash kernel at every length, so the query limit applies to
    the other dtypes only; the long prefill's rows still equal the fp32 reference."""
    kernels = cpu_kernels.ops()
    if kernels is None or not kernels.paged_prefill_has_bf16_tiles(torch.bfloat16, 64, 16):
        pytest.skip("no vdpbf16ps prefill tiles on this CPU")
    monkeypatch.setattr(attention, "KERNEL_PREFILL_MAX_QUERIES", 40)
    query, kv_cache, metadata, _ = _long_prefill_scenario(64, torch.bfloat16)
    plan = attention._group_plan(metadata, 0, None, kv_cache, kv_cache.dtype)
    assert plan.kernel_prefill.query_lens.tolist() == [45, 37, 3] and plan.prefills == ()
    reference = reference_paged_attention(query.float(), kv_cache.float(), metadata, 0, 0.125,
                                          None)
    out = paged_attention(query, kv_cache, metadata, 0, 0.125, None)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("bf16_tiles")
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (16, 2)])
@pytest.mark.parametrize("block", [16, 8, 32])
def test_bf16_prefill_tiles_share_packed_pages_and_ignore_stale_slots(block, num_heads,
                                                                      num_kv_heads, head_dim,
                                                                      window):
    """The bf16 tiles pack each sequence's keys once into 16-key pages, in runs of 32 pages, for
    all its tiles, whatever the cache's block size (a packed page is half of a 32-token block or
    two 8-token ones): chunks over prefixes longer than a run, a fresh prompt, a window starting
    inside a page; slots past a sequence's last token hold NaN (another request's leftovers) and
    change nothing."""
    kernels = cpu_kernels.ops()
    if kernels is None or not kernels.paged_prefill_has_bf16_tiles(torch.bfloat16, head_dim,
                                                                    block):
        pytest.skip("no vdpbf16ps prefill tiles on this CPU")
    gen = torch.Generator().manual_seed(5)
    num_computed, query_lens = [600, 0, 517, 21], [37, 45, 70, 3]
    counts = [-(-(c + n) // block) for c, n in zip(num_computed, query_lens)]
    order = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    kv_cache = torch.randn(2, sum(counts) + 1, block, num_kv_heads, head_dim, generator=gen)
    tables, used = [], 0
    for computed, length, count in zip(num_computed, query_lens, counts):
        tables.append(order[used:used + count])
        used += count
        kv_cache[:, tables[-1][-1], (computed + length) % block or block:] = float("nan")
    kv_cache = kv_cache.to(torch.bfloat16)
    metadata = build_attention_metadata(num_computed, query_lens, [tables], block)
    plan = attention._group_plan(metadata, 0, window, kv_cache, kv_cache.dtype)
    assert plan.kernel_prefill is not None and plan.prefills == ()
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    reference = reference_paged_attention(query.float(), kv_cache.float(), metadata, 0, scale,
                                          window)
    out = paged_attention(query, kv_cache, metadata, 0, scale, window)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("bf16_tiles")
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (16, 2)])
@pytest.mark.parametrize("num_computed,query_len", [(2032, 16), (2048, 3), (700, 32), (200, 5)])
def test_bf16_few_tiles_over_long_prefixes_split_their_keys_and_match_reference(
        num_computed, query_len, num_heads, num_kv_heads, head_dim, window, monkeypatch):
    """A few new tokens over a long prefix are fewer (tile, kv head) items than twice the threads:
    without a window the vdpbf16ps tiles split each one's prefix keys into parts run as items of
    their own and merge the parts' softmax sums after (two threads: 2,032 cached keys in two
    parts; 200 is under two 128-key chunks and stays whole). Slots past the last token hold
    NaN."""
    kernels = cpu_kernels.ops()
    if kernels is None or not kernels.paged_prefill_has_bf16_tiles(torch.bfloat16, head_dim, 16):
        pytest.skip("no vdpbf16ps prefill tiles on this CPU")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split depends on the thread count: two, as on 2 cores
    try:
        gen = torch.Generator().manual_seed(7)
        count = -(-(num_computed + query_len) // 16)
        table = (torch.randperm(count, generator=gen) + 1).tolist()
        kv_cache = torch.randn(2, count + 1, 16, num_kv_heads, head_dim, generator=gen)
        kv_cache[:, table[-1], (num_computed + query_len) % 16 or 16:] = float("nan")
        kv_cache = kv_cache.to(torch.bfloat16)
        metadata = build_attention_metadata([num_computed], [query_len], [[table]], 16)
        plan = attention._group_plan(metadata, 0, window, kv_cache, kv_cache.dtype)
        assert plan.kernel_prefill is not None
        query = torch.randn(query_len, num_heads, head_dim, generator=gen).to(torch.bfloat16)
        scale = head_dim ** -0.5
        reference = reference_paged_attention(query.float(), kv_cache.float(), metadata, 0,
                                              scale, window)
        out = paged_attention(query, kv_cache, metadata, 0, scale, window)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


def test_write_kv_fills_exactly_the_mapped_slots():
    kv_cache = torch.zeros(2, 8, BLOCK, 1, 2)
    metadata = build_attention_metadata([3, 0], [2, 1], [[[5, 2], [7]]], BLOCK)
    assert metadata.slot_mapping[0].tolist() == [5 * 4 + 3, 2 * 4 + 0, 7 * 4 + 0]
    key = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]])
    write_kv(kv_cache, key, -key, metadata.slot_mapping[0])
    assert kv_cache[0, 5, 3, 0].tolist() == [1.0, 1.0]
    assert kv_cache[0, 2, 0, 0].tolist() == [2.0, 2.0]
    assert kv_cache[1, 7, 0, 0].tolist() == [-3.0, -3.0]
    assert kv_cache.abs().sum().item() == 2 * (2 + 4 + 6)


class RecordingHooks:
    """Stands in for a KVConnectorWorker: records the per-layer hook calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(f"wait {layer_name}")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata) -> None:
        # The layer's new K must already be in the cache when it is saved.
        slot = attn_metadata.slot_mapping[0][0].item()
        assert kv_layer[0].flatten(0, 1)[slot].abs().sum() > 0
        self.calls.append(f"save {layer_name}")


def test_layer_hooks_wrap_every_layer_in_order(model_pair):
    _, loaded = model_pair
    driver = PagedDriver(loaded.model)
    hooks = RecordingHooks()
    metadata = build_attention_metadata(
        [0], [3], [[[5]] for _ in loaded.model.kv_cache_groups()], 4, layer_hooks=hooks)
    with torch.no_grad():
        loaded.model(torch.tensor([4, 5, 6]), torch.arange(3), driver.kv_caches, metadata)
    assert hooks.calls == ["wait model.layers.0.self_attn", "save model.layers.0.self_attn",
                           "wait model.layers.1.self_attn", "save model.layers.1.self_attn"]
