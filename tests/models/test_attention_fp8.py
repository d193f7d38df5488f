"""An fp8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2): write_kv stores K and V rounded to the
format and saturated, and every attention path (the C++ decode kernel reading fp8 pages, the
prefill kernel over staged pages, the torch fallback) equals the fp32 reference over the same
stored values."""

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

from .helpers import scattered_decodes

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_cache(shape: tuple[int, ...], fmt: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normal values scaled down by up to 2^-10, so small ones take the format's subnormal
    codes (test_gather_fp8_pages_converts_every_byte_exactly covers every code)."""
    values = torch.randn(shape, generator=gen) * torch.exp2(-10 * torch.rand(shape, generator=gen))
    return values.to(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_rounds_to_the_format_and_saturates(fmt):
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=fmt)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(3, 2, 8, generator=gen) * 3
    value = torch.randn(3, 2, 8, generator=gen) * 1e-3
    limit = torch.finfo(fmt).max
    key[0, 0, 0], value[1, 1, 1] = 10 * limit, -10 * limit
    slots = torch.tensor([5, 0, 14])
    write_kv(cache, key, value, slots)
    stored_k = cache[0].view(-1, 2, 8)[slots].float()
    stored_v = cache[1].view(-1, 2, 8)[slots].float()
    assert stored_k[0, 0, 0] == limit and stored_v[1, 1, 1] == -limit
    torch.testing.assert_close(stored_k, key.clamp(-limit, limit).to(fmt).float(),
                               atol=0, rtol=0)
    torch.testing.assert_close(stored_v, value.clamp(-limit, limit).to(fmt).float(),
                               atol=0, rtol=0)
    assert stored_v.abs().sum() > 0  # small values keep their subnormal codes
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (cache[0].view(16, -1)[untouched].float() == 0).all()


def _decode_case(fmt: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int):
    gen = torch.Generator().manual_seed(4)
    kv_cache = _fp8_cache((2, 48, 16, num_kv_heads, head_dim), fmt, gen)
    seq_lens = [1, 16, 17, 100, 37]
    metadata = scattered_decodes(seq_lens, 48, 16, gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return query, kv_cache, metadata


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 16, 2)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_decodes_over_fp8_pages_match_reference(fmt, head_dim, num_heads, num_kv_heads,
                                                     window):
    """bf16 queries on 16-slot pages: the kernel's vdpbf16ps tiles over pages converted to bf16
    (exactly: every fp8 value is a bf16 one); only the bf16 rounding of the softmax weights
    and the output differ from the fp32 reference."""
    query, kv_cache, metadata = _decode_case(fmt, head_dim, num_heads, num_kv_heads)
    query = query.to(torch.bfloat16)
    scale = head_dim ** -0.5
    reference = reference_paged_attention(query.float(), kv_cache, metadata, 0, scale, window)
    out = paged_attention(query, kv_cache, metadata, 0, scale, window)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=2e-2)


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_decodes_over_fp8_pages_equal_reference(fmt):
    """fp32 queries take the generic kernel, each stored byte converted exactly to fp32."""
    query, kv_cache, metadata = _decode_case(fmt, 64, 9, 3)
    reference = reference_paged_attention(query, kv_cache, metadata, 0, 0.125, None)
    out = paged_attention(query, kv_cache, metadata, 0, 0.125, None)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("attention_path")
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_steps_over_fp8_pages_match_reference(fmt, dtype, window):
    """Chunks over long cached prefixes, a fresh prompt and a decode in one step: the prefills
    read their blocks staged in the query dtype (the C++ prefill kernel, or the torch path),
    with a window none of those wholly before it (poisoned here with NaN codes)."""
    gen = torch.Generator().manual_seed(5)
    num_computed, query_lens = [70, 0, 33, 100], [45, 37, 1, 3]
    order = torch.randperm(63, generator=gen) + 1
    tables, used = [], 0
    for computed, length in zip(num_computed, query_lens):
        count = -(-(computed + length) // 16)
        tables.append(order[used:used + count].tolist())
        used += count
    kv_cache = _fp8_cache((2, 64, 16, 3, 64), fmt, gen)
    metadata = build_attention_metadata(num_computed, query_lens, [tables], 16)
    query = torch.randn(sum(query_lens), 9, 64, generator=gen).to(dtype)
    reference = reference_paged_attention(query.float(), kv_cache, metadata, 0, 0.125, window)
    if window is not None:  # seq 0's queries start at 70: keys before 31 are outside the window
        kv_cache.view(torch.uint8)[:, tables[0][0]] = 0x7F  # NaN in both formats
    out = paged_attention(query, kv_cache, metadata, 0, 0.125, window)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


def test_prefills_stage_only_the_blocks_they_attend():
    """A window's earlier blocks and a table's columns past a sequence's end stay unread."""
    if cpu_kernels.ops() is None:
        pytest.skip("no C++ kernels: no staged prefill")
    tables = [[9, 3, 5, 7, 11, 13, 2], [4, 6]]  # seq 0: 100 tokens, seq 1: 20
    metadata = build_attention_metadata([90, 0], [10, 20], [tables], 16)
    kv_cache = torch.zeros(2, 16, 16, 2, 64, dtype=torch.float8_e4m3fn)
    plan = attention._group_plan(metadata, 0, 40, kv_cache, torch.bfloat16).kernel_prefill
    # seq 0's queries 90-99 attend keys from 51 (blocks 3-6), seq 1 all of its two blocks; the
    # null block 0 stands in for every other column.
    assert sorted(plan.staged_rows[:len(plan.staged_rows) // 2].tolist()) == [0, 2, 4, 6, 7,
                                                                            11, 13]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_fp8_pages_converts_every_byte_exactly(fmt, dtype):
    kernels = cpu_kernels.ops()
    if kernels is None:
        pytest.skip("no C++ kernels")
    every = torch.arange(256, dtype=torch.uint8)
    finite = every.view(fmt).float().isfinite()
    # 4 pages of 164 bytes (not a multiple of the 64-byte vector step): every byte twice over.
    pages = torch.cat([every, every.flip(0), every[:144]]).view(fmt).reshape(4, 164)
    rows = torch.tensor([3, 0, 0, 2, 1])
    out = kernels.gather_fp8_pages(pages, rows, dtype)
    expected = pages[rows].float().to(dtype)
    assert out.dtype == dtype and out.shape == (5, 164)
    keep = pages[rows].float().isfinite()
    assert torch.equal(out[keep], expected[keep])
    assert finite.sum() < 256  # the NaN codes are left out of the comparison, not converted
