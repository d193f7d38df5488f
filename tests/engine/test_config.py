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


@pytest.mark.parametrize("options, message", [
    ({"device": "nosuch"}, "^device 'nosuch' is not a device PyTorch knows \\(.*\\); give cpu, "
                           "cuda or cuda:N$"),
    ({"device": "cuda:x"}, "^device 'cuda:x' is not a device PyTorch knows"),
    ({"device": "meta"}, "^device meta: this PyTorch build cannot run a model on meta"),
    ({"seed": 2**64}, "^seed must be an integer in \\[-2\\*\\*63, 2\\*\\*64 - 1\\], got "
                      "18446744073709551616$"),
    ({"seed": -(2**63) - 1}, "^seed must be an integer"),
    ({"seed": 1.5}, "^seed must be an integer"),
])
def test_device_and_seed_are_checked_before_the_model_loads(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**options)
    assert EngineConfig.create(device="cpu", seed=2**64 - 1).model.seed == 2**64 - 1


def test_cuda_on_a_build_without_it_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ValueError, match=r"^device cuda: this PyTorch build has no CUDA \(torch "
                                         r".*\); give device cpu, or install a CUDA build"):
        EngineConfig.create(device="cuda")


def test_cuda_with_no_visible_device_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device cuda:1: no CUDA device is visible"):
        EngineConfig.create(device="cuda:1")


@pytest.mark.parametrize("options, where", [
    ({"kv_offload": "host=4GiB"}, "kv_offload host"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": "4GiB"}}},
     "kv_transfer_config kv_connector_extra_config.cpu_bytes_to_use"),
])
def test_a_host_budget_past_available_memory_is_refused(options, where, monkeypatch):
    monkeypatch.setattr("kvtier.config.available_memory_bytes", lambda: 2**30)
    with pytest.raises(ValueError) as info:
        EngineConfig.create(**options)
    assert str(info.value) == (f"{where}: 4294967296 bytes (4.0 GiB) is more than this "
                               "machine's available memory (1.0 GiB); give at most 1073741824 "
                               "bytes")
    assert EngineConfig.create(kv_offload="host=1GiB").kv_transfer_config is not None
