import pytest
import torch

from kvtier.kv import FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from kvtier.models.config import ModelConfig
from kvtier.worker.kv_cache import (
    allocate_kv_caches,
    block_bytes,
    build_kv_cache_groups,
    plan_num_blocks,
)


def model_config(windows, **options):
    return ModelConfig(architecture="qwen2", vocab_size=32, hidden_size=32, intermediate_size=64,
                       num_layers=len(windows), num_heads=4, num_kv_heads=2, head_dim=8,
                       rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                       max_position_embeddings=64, sliding_window=8,
                       layer_sliding_windows=tuple(windows), tie_word_embeddings=False,
                       attention_bias=True, o_proj_bias=False, qk_norm=False, bos_token_id=None,
                       eos_token_ids=(), name="tiny", **options)


def test_one_group_per_window_full_attention_first():
    groups = build_kv_cache_groups(model_config([8, None, 8, None]), block_size=4, dtype_size=2)
    assert [g.layer_names for g in groups] == [
        ["model.layers.1.self_attn", "model.layers.3.self_attn"],
        ["model.layers.0.self_attn", "model.layers.2.self_attn"]]
    assert groups[0].kv_cache_spec == FullAttentionSpec(4, 2, 8, 2)
    assert groups[1].kv_cache_spec == SlidingWindowSpec(4, 2, 8, 2, sliding_window=8)


def test_short_conv_layers_form_a_last_group_of_state_pages():
    config = model_config([None, None, 8, None], conv_layer_indices=(0, 3),
                          conv_kernel_size=3)
    groups = build_kv_cache_groups(config, block_size=4, dtype_size=2)
    assert [g.layer_names for g in groups] == [
        ["model.layers.1.self_attn"], ["model.layers.2.self_attn"],
        ["model.layers.0.conv", "model.layers.3.conv"]]
    assert groups[2].kv_cache_spec == MambaSpec(4, ((2, 32),), 2)
    assert config.layer_group_ids == (2, 0, 1, 2)
    # K+V pages of two attention layers (256 bytes each), two 2 x 32 state pages (128 each)
    assert block_bytes(groups) == 2 * 256 + 2 * 128
    caches = allocate_kv_caches(KVCacheConfig(5, groups), layer_names=config.layer_names,
                                dtype=torch.float32, device=torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(1, 5, 2, 32), (2, 5, 4, 2, 8),
                                                (2, 5, 4, 2, 8), (1, 5, 2, 32)]


def test_block_count_from_bytes_is_capped_by_what_sequences_can_use():
    page = 2 * 4 * 2 * 8 * 2  # K+V of one block of one layer = 256 bytes
    common = dict(block_bytes=2 * page, block_size=4, num_blocks=None, max_model_len=64)
    assert plan_num_blocks(memory_bytes=2 * page * 40, max_num_seqs=8, **common) == 40
    # 2 sequences x 16 blocks + the null block
    assert plan_num_blocks(memory_bytes=2 * page * 1000, max_num_seqs=2, **common) == 33
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=512"):
        plan_num_blocks(memory_bytes=2 * page, max_num_seqs=2, **common)


def test_caches_are_zeroed_per_layer_in_layer_order():
    config = model_config([None, 8])
    groups = build_kv_cache_groups(config, block_size=4, dtype_size=4)
    caches = allocate_kv_caches(KVCacheConfig(5, groups), layer_names=config.layer_names,
                                dtype=torch.float32, device=torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 5, 4, 2, 8)] * 2
    assert all(int(c.count_nonzero()) == 0 for c in caches)


def test_a_pool_the_device_cannot_hold_is_refused_naming_the_flag():
    page = 2 * 4 * 2 * 8 * 2  # K+V of one block of one layer = 256 bytes
    common = dict(block_bytes=2 * page, block_size=4, max_model_len=64, max_num_seqs=8)
    with pytest.raises(ValueError) as info:
        plan_num_blocks(memory_bytes=None, num_blocks=10**11, available_bytes=512 * 100,
                        **common)
    assert str(info.value) == (
        "--num-device-blocks: 100000000000 KV blocks of 512 bytes need 51200000000000 bytes "
        "(46.6 TiB), more than the device has available (50.0 KiB); give at most "
        "--num-device-blocks 100")
    # The budget is capped at what 8 sequences use (8 x 16 + 1 blocks): 66048 bytes.
    with pytest.raises(ValueError, match="^--kv-cache-memory-bytes: 129 KV blocks of 512 bytes "
                                         r"need 66048 bytes \(64.5 KiB\), more than the device "
                                         r"has available \(50.0 KiB\); give at most "
                                         "--kv-cache-memory-bytes 51200$"):
        plan_num_blocks(memory_bytes=2**40, num_blocks=None, available_bytes=512 * 100, **common)
    assert plan_num_blocks(memory_bytes=2**40, num_blocks=None, available_bytes=66048,
                           **common) == 129
    assert plan_num_blocks(memory_bytes=None, num_blocks=100, available_bytes=51200,
                           **common) == 100


def test_engine_start_checks_the_block_count_against_available_memory(tmp_path, monkeypatch):
    from kvtier import LLM

    from ..tiny_models import make_hf_model

    make_hf_model("llama", tmp_path)
    # As if the machine had 1 KiB left: 32 blocks of this model take more.
    monkeypatch.setattr("kvtier.worker.kv_cache.available_memory_bytes", lambda: 1024)
    with pytest.raises(ValueError, match="^--num-device-blocks: 32 KV blocks of .* more than "
                                         r"the device has available \(1.0 KiB\)"):
        LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=32, device="cpu")
