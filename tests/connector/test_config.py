"""KVTransferConfig parsing: vLLM's JSON shape, typed fields, clear errors."""

import json

import pytest

from kvtier.connector import KVTransferConfig
from kvtier.connector.config import parse_options
from kvtier.connector.example import ExampleConnectorOptions
from kvtier.offload.config import OffloadConfig


def test_from_json_reads_every_field():
    config = KVTransferConfig.from_json(json.dumps({
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"},
        "kv_connector_module_path": "my_pkg.connectors",
        "kv_load_failure_policy": "fail",
        "kv_load_timeout_s": 2.5,
    }))
    assert config == KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": "/tmp/kv"},
        kv_connector_module_path="my_pkg.connectors", kv_load_failure_policy="fail",
        kv_load_timeout_s=2.5)
    assert (config.is_producer, config.is_consumer) == (False, True)


def test_defaults_and_roles():
    config = KVTransferConfig.from_dict({"kv_connector": "ExampleConnector"})
    assert (config.kv_role, config.kv_load_failure_policy, config.kv_load_timeout_s) == \
        ("kv_both", "recompute", 30.0)
    assert config.kv_connector_extra_config == {}
    assert config.kv_connector_module_path is None
    assert (config.is_producer, config.is_consumer) == (True, True)
    producer = KVTransferConfig("X", kv_role="kv_producer")
    assert (producer.is_producer, producer.is_consumer) == (True, False)


def test_round_trips_through_to_dict_and_hashes():
    config = KVTransferConfig("ExampleConnector", kv_connector_extra_config={"a": 1})
    assert KVTransferConfig.from_dict(config.to_dict()) == config
    assert hash(config) == hash(KVTransferConfig("ExampleConnector",
                                                 kv_connector_extra_config={"b": 2}))


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ValueError) as err:
        KVTransferConfig.from_dict({"kv_connector": "X", "kv_rol": "kv_both"})
    assert str(err.value) == (
        "kv_transfer_config: unknown key 'kv_rol'; valid keys are ['kv_connector', "
        "'kv_connector_extra_config', 'kv_connector_module_path', 'kv_load_failure_policy', "
        "'kv_load_timeout_s', 'kv_role']")


@pytest.mark.parametrize("raw, field", [
    ({"kv_connector": ""}, "kv_connector"),
    ({"kv_connector": 3}, "kv_connector"),
    ({"kv_connector": "X", "kv_role": "kv_sender"}, "kv_role"),
    ({"kv_connector": "X", "kv_connector_extra_config": "dir=/tmp"}, "kv_connector_extra_config"),
    ({"kv_connector": "X", "kv_connector_module_path": ""}, "kv_connector_module_path"),
    ({"kv_connector": "X", "kv_load_failure_policy": "ignore"}, "kv_load_failure_policy"),
    ({"kv_connector": "X", "kv_load_timeout_s": 0}, "kv_load_timeout_s"),
    ({"kv_connector": "X", "kv_load_timeout_s": "5"}, "kv_load_timeout_s"),
    ({"kv_connector": "X", "kv_load_timeout_s": True}, "kv_load_timeout_s"),
])
def test_bad_value_names_the_field(raw, field):
    with pytest.raises(ValueError, match=rf"^kv_transfer_config\.{field} "):
        KVTransferConfig.from_dict(raw)


def test_missing_connector_and_bad_json():
    with pytest.raises(ValueError, match="kv_transfer_config.kv_connector is required"):
        KVTransferConfig.from_dict({"kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_transfer_config is not valid JSON"):
        KVTransferConfig.from_json("{kv_connector: X}")
    with pytest.raises(ValueError, match="kv_transfer_config must be a JSON object"):
        KVTransferConfig.from_json('["ExampleConnector"]')


def test_connector_options_parse_into_their_dataclass():
    options = parse_options(ExampleConnectorOptions, {"shared_storage_path": "/tmp/kv"}, "Ex")
    assert options == ExampleConnectorOptions(shared_storage_path="/tmp/kv", flush_timeout_s=30.0)
    with pytest.raises(ValueError, match=r"^Ex: unknown key 'path'; valid keys are "
                                         r"\['flush_timeout_s', 'secret_file', "
                                         r"'shared_storage_path'\]$"):
        parse_options(ExampleConnectorOptions, {"path": "/tmp/kv"}, "Ex")
    with pytest.raises(ValueError, match="^Ex: missing required key 'shared_storage_path'$"):
        parse_options(ExampleConnectorOptions, {}, "Ex")
    with pytest.raises(ValueError, match="flush_timeout_s must be a number of seconds > 0"):
        parse_options(ExampleConnectorOptions,
                      {"shared_storage_path": "/tmp/kv", "flush_timeout_s": -1}, "Ex")


def test_offloading_options_are_parsed_once_at_construction():
    config = KVTransferConfig.from_json(json.dumps({
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes_to_use": "1MiB", "blocks_per_chunk": 2}}))
    assert config.options == OffloadConfig(cpu_bytes_to_use=2**20, blocks_per_chunk=2)
    # The user's dict is kept as written: it is what to_dict gives back.
    assert config.to_dict()["kv_connector_extra_config"] == {"cpu_bytes_to_use": "1MiB",
                                                             "blocks_per_chunk": 2}
    assert KVTransferConfig.from_dict(config.to_dict()).options == config.options
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.eviction_policy must be "):
        KVTransferConfig("OffloadingConnector",
                         kv_connector_extra_config={"cpu_bytes_to_use": 1,
                                                    "eviction_policy": "fifo"})


def test_multi_connector_children_are_parsed_with_their_own_options():
    config = KVTransferConfig("MultiConnector", kv_role="kv_consumer",
                              kv_connector_extra_config={"connectors": [
                                  {"kv_connector": "OffloadingConnector",
                                   "kv_connector_extra_config": {"cpu_bytes_to_use": 4096}},
                                  {"kv_connector": "ExampleConnector"}]})
    offloading, example = config.options
    assert offloading.kv_role == "kv_consumer"  # inherited
    assert offloading.options == OffloadConfig(cpu_bytes_to_use=4096)
    assert example.options is None  # parses its own options when created
    with pytest.raises(ValueError, match="^kv_connector_extra_config: unknown key 'cpu'"):
        KVTransferConfig("MultiConnector", kv_connector_extra_config={"connectors": [
            {"kv_connector": "OffloadingConnector",
             "kv_connector_extra_config": {"cpu": 4096}}]})


def test_connectors_parsing_their_own_options_get_none():
    assert KVTransferConfig("ExampleConnector").options is None
    # An out-of-tree class of that name is not the built-in one: its module parses its options.
    assert KVTransferConfig("OffloadingConnector", kv_connector_module_path="my.pkg",
                            kv_connector_extra_config={"anything": 1}).options is None


def test_bad_json_names_the_option_and_shows_an_example():
    with pytest.raises(ValueError) as err:
        KVTransferConfig.from_json("{bad", "--kv-transfer-config")
    assert str(err.value) == (
        "--kv-transfer-config is not valid JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)): '{bad'; write it like {\"kv_connector\": "
        "\"OffloadingConnector\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": "
        "\"4GiB\"}}")
    example = str(err.value).split("write it like ", 1)[1]
    assert KVTransferConfig.from_json(example).options.cpu_bytes_to_use == 4 * 2**30
