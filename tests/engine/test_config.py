import json

import pytest

from kvtier.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulingConfig
from kvtier.offload.config import OffloadConfig
from kvtier.offload.tiers.fs import FsTierOptions


def test_create_routes_flat_options_to_their_sections():
    config = EngineConfig.create(model="/m", dtype="fp32", block_size=32, max_num_seqs=4,
                                 enable_prefix_caching=False, kv_offload="host=1GiB")
    assert config.model == ModelLoadConfig(model="/m", dtype="float32")
    assert config.cache == CacheConfig(block_size=32, enable_prefix_caching=False)
    assert config.scheduler == SchedulingConfig(max_num_seqs=4)
    assert config.kv_transfer_config.options.cpu_bytes_to_use == 2**30


def test_offload_flag_and_its_json_form_give_the_same_typed_config(tmp_path):
    flag = EngineConfig.create(kv_offload=f"host=1GiB,fs={tmp_path}:2GiB,policy=arc,write=back")
    json_form = EngineConfig.create(kv_transfer_config=json.dumps({
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": "1GiB", "eviction_policy": "arc", "write_policy": "write_back",
            "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path),
                                 "max_bytes": "2GiB"}]}}))
    # Spelt differently ("1GiB" against 1073741824), parsed the same.
    assert flag.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert flag.kv_transfer_config.kv_role == json_form.kv_transfer_config.kv_role == "kv_both"
    options = flag.kv_transfer_config.options
    assert isinstance(options, OffloadConfig)
    assert options == json_form.kv_transfer_config.options
    assert (options.cpu_bytes_to_use, options.eviction_policy, options.write_policy) == \
        (2**30, "arc", "write_back")
    assert options.secondary_tiers[0].options == FsTierOptions(root_dir=str(tmp_path),
                                                               max_bytes=2 * 2**30)


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
    with pytest.raises(ValueError, match="^give kv_transfer_config or kv_offload, not both$"):
        EngineConfig.create(kv_transfer_config={"kv_connector": "ExampleConnector"},
                            kv_offload="host=1GiB")


@pytest.mark.parametrize("options, message", [
    ({"kv_offload": "host=bad"}, "^kv_offload host must be a byte size"),
    ({"kv_transfer_config": "{bad"}, "^kv_transfer_config is not valid JSON"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 1,
                                                           "eviction": "arc"}}},
     "^kv_connector_extra_config: unknown key 'eviction'"),
])
def test_offload_options_are_checked_by_create(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**options)
