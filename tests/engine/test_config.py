import pytest

from kvtier.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulingConfig


def test_create_routes_flat_options_to_their_sections():
    config = EngineConfig.create(model="/m", dtype="fp32", block_size=32, max_num_seqs=4,
                                 enable_prefix_caching=False, kv_offload="host=1GiB")
    assert config.model == ModelLoadConfig(model="/m", dtype="float32")
    assert config.cache == CacheConfig(block_size=32, enable_prefix_caching=False)
    assert config.scheduler == SchedulingConfig(max_num_seqs=4)
    assert config.kv_offload == "host=1GiB"


@pytest.mark.parametrize("options, names", [
    ({"block_size": 0}, "block_size"),
    ({"dtype": "int3"}, "dtype"),
    ({"num_device_blocks": 1}, "num_device_blocks"),
    ({"kv_cache_memory_bytes": 10, "num_device_blocks": 10}, "kv_cache_memory_bytes"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"policy": "lifo"}, "policy"),
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"watermark": 1.5}, "watermark"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"blocksize": 16}, "blocksize"),
])
def test_bad_options_name_the_field(options, names):
    with pytest.raises(ValueError, match=names):
        EngineConfig.create(**options)


def test_transfer_config_json_is_parsed_and_cannot_combine_with_offload():
    config = EngineConfig.create(kv_transfer_config='{"kv_connector": "ExampleConnector"}')
    assert config.kv_transfer_config.kv_connector == "ExampleConnector"
    with pytest.raises(ValueError, match="kv_offload"):
        EngineConfig.create(kv_transfer_config={"kv_connector": "ExampleConnector"},
                            kv_offload="host=1GiB")
