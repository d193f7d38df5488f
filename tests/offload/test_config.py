import json
import re
from pathlib import Path

import pytest

from kvtier.common.sizes import parse_size
from kvtier.offload.config import OffloadConfig, TierSpec, parse_kv_offload
from kvtier.offload.tiers.fs import FsTierOptions
from kvtier.offload.tiers.memory import MemoryTierOptions


def test_parse_size_units():
    assert parse_size("4GiB", "x") == 4 * 2**30
    assert parse_size("512MiB", "x") == 512 * 2**20
    assert parse_size("1.5GB", "x") == 1_500_000_000
    assert parse_size(1024, "x") == 1024
    with pytest.raises(ValueError, match="x must be a byte size"):
        parse_size("four gigs", "x")


def test_seed_json_form_parses_into_typed_config(tmp_path):
    config = OffloadConfig.from_extra_config({
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
        "blocks_per_chunk": 2, "eviction_policy": "arc", "offload_prompt_only": True,
        "store_threshold": 2,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "max_bytes": "1MiB"},
                            {"type": "memory"}, {"type": "memory", "max_bytes": 4096}]})
    assert config.cpu_bytes_to_use == 1 << 20
    assert config.blocks_per_chunk == 2
    assert config.eviction_policy == "arc"
    assert [t.name for t in config.secondary_tiers] == ["fs", "memory", "memory1"]
    assert config.secondary_tiers[0].options == FsTierOptions(root_dir=str(tmp_path),
                                                              max_bytes=1 << 20)
    assert config.secondary_tiers[2].options == MemoryTierOptions(max_bytes=4096)


@pytest.mark.parametrize("extra, message", [
    ({"cpu_bytes_to_use": 1, "cpu_bytes": 2}, "unknown key 'cpu_bytes'"),
    ({}, "missing required key 'cpu_bytes_to_use'"),
    ({"cpu_bytes_to_use": 1, "eviction_policy": "fifo"}, "eviction_policy must be one of"),
    ({"cpu_bytes_to_use": 1, "blocks_per_chunk": 0}, "blocks_per_chunk must be an integer"),
    ({"cpu_bytes_to_use": 1, "write_policy": "back"}, "write_policy must be one of"),
    ({"cpu_bytes_to_use": 1, "spec_name": "Other"}, "spec_name must be 'TieringOffloadingSpec'"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs"}]}, "missing required key "
                                                                    "'root_dir'"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs", "root_dir": "/x", "size": 1}]},
     r"secondary_tiers\[0\]: unknown key 'size'"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "tape"}]}, "unknown secondary tier "
                                                                      "type 'tape'"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "X", "module_path": "no.such"}]},
     "cannot import tier module 'no.such'"),
])
def test_bad_extra_config_names_the_problem(extra, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config(extra)


def test_one_flag_form_expands_to_the_json_form():
    assert parse_kv_offload("host=4GiB,disk=/var/cache/kvtier:50GiB") == {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * 2**30,
        "secondary_tiers": [{"type": "disk", "root_dir": "/var/cache/kvtier",
                             "max_bytes": 50 * 2**30}]}


def test_one_flag_form_options():
    extra = parse_kv_offload("host=1MiB,disk=/d:1GiB,fs=/a:b/c,fs=/nfs:2GiB,policy=arc,"
                             "blocks_per_chunk=4,write=back")
    assert extra["secondary_tiers"] == [
        {"type": "disk", "root_dir": "/d", "max_bytes": 2**30},
        {"type": "fs", "root_dir": "/a:b/c"},
        {"type": "fs", "root_dir": "/nfs", "max_bytes": 2 * 2**30}]
    assert extra["eviction_policy"] == "arc"
    assert extra["blocks_per_chunk"] == 4
    assert OffloadConfig.from_extra_config(extra).write_policy == "write_back"
    assert OffloadConfig.from_extra_config({"cpu_bytes_to_use": 1}).write_policy == \
        "write_through"


@pytest.mark.parametrize("flag, message", [
    ("disk=/x:1GiB", r"^--kv-offload: 'host=SIZE' is required \(e\.g\. host=4GiB,"),
    ("host=4GiB,disk=/x", r"disk tier needs a size, e\.g\. disk=/x:50GiB .*use fs=/x"),
    ("host=4GiB,ssd=/x", "^--kv-offload: unknown key 'ssd'; keys are host, disk, fs, obj, redis, "
                         "p2p, p2p_listen, policy, blocks_per_chunk, write, "
                         "e.g. host=4GiB,disk=/var/cache/kvtier:50GiB$"),
    ("host", "^--kv-offload: expected comma-separated key=value pairs such as "),
    ("host=lots", "^--kv-offload host must be a byte size such as 4GiB, 512MiB or 1073741824, "
                  "got 'lots'$"),
    ("host=0", r"^--kv-offload host must be at least one byte \(a bare number is bytes\), "
               r"e\.g\. host=4GiB, got '0'$"),
    ("host=1GiB,host=2GiB", r"^--kv-offload: host= is given twice; give it once$"),
    # A number after a tier's last ':' is its size, at least 4KiB: never a silent 1-byte budget.
    ("host=1GiB,fs=/data/2024:01", r"^--kv-offload fs=/data/2024:01: the size after the last "
                                   r"':' \('01'\) must be at least 4KiB"),
    ("host=1GiB,fs=/data:-5GiB", r"the size after the last ':' \('-5GiB'\) must be at least"),
    ("host=1GiB,obj=s3://b/p:-1", r"^--kv-offload obj=s3://b/p:-1: the size after the last"),
    ("host=1GiB,fs=/data:50GiB:", r"^--kv-offload fs=/data:50GiB:: ends with ':'"),
    ("host=1GiB,fs=:5GiB", r"^--kv-offload fs=:5GiB: needs a directory or URL before ':5GiB'"),
    ("host=1MiB,policy=mru", r"^--kv-offload policy must be lru or arc, e\.g\. policy=arc, "
                             "got 'mru'$"),
    ("host=1MiB,blocks_per_chunk=0", "^--kv-offload blocks_per_chunk must be an integer >= 1"),
    ("host=1MiB,write=later", "^--kv-offload write must be through or back"),
])
def test_bad_flag_names_the_problem(flag, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_offload(flag)


@pytest.mark.parametrize("extra, value", [
    ({"cpu_bytes_to_use": 4294967296.0}, ("cpu_bytes_to_use", 2**32)),  # an integral float
    ({"cpu_bytes_to_use": 1, "store_threshold": 0}, ("store_threshold", 1)),  # vLLM's off
    ({"cpu_bytes_to_use": 1, "spec_name": "CPUOffloadingSpec"}, ("secondary_tiers", ())),
])
def test_vllms_offloading_values_are_taken(extra, value):
    assert getattr(OffloadConfig.from_extra_config(extra), value[0]) == value[1]


@pytest.mark.parametrize("extra, message", [
    ({"block_size": 64}, r"^kv_connector_extra_config\.block_size: kvtier sizes chunks in "
                         r"device blocks: set blocks_per_chunk"),
    ({"tier_job_timeout_s": True}, r"tier_job_timeout_s must be a number of seconds > 0"),
    ({"secondary_tiers": [{"type": "fs", "root_dir": "/a", "name": "host"}]},
     r"secondary_tiers\[0\]\.name must be a string naming this tier alone"),
    ({"secondary_tiers": [{"type": "fs", "root_dir": "/a", "name": "t"},
                          {"type": "fs", "root_dir": "/b", "name": "t"}]},
     r"secondary_tiers\[1\]\.name must be a string naming this tier alone"),
    ({"secondary_tiers": [{"type": "redis", "url": "redis://h:1/0"},
                          {"type": "redis", "url": "redis://h:1/0"}]},
     r"a redis tier at redis://h:1/0\): every chunk would be written there twice"),
    (parse_kv_offload("host=1GiB,disk=/d:1GiB,disk=/d/:1GiB"),
     r"secondary_tiers\[1\] is secondary_tiers\[0\] again \(a disk tier at /d\)"),
    (parse_kv_offload("host=1GiB,disk=/d:1GiB,disk=/d/../x/../d:1GiB"),
     r"secondary_tiers\[1\] is secondary_tiers\[0\] again \(a disk tier at /d\)"),
    (parse_kv_offload("host=1GiB,obj=s3://b/p,obj=s3://b/p/"),
     r"secondary_tiers\[1\] is secondary_tiers\[0\] again \(a obj tier at s3://b/p\)"),
    (parse_kv_offload("host=1GiB,redis=redis://h:1/0,redis=redis://H:1"),
     r"secondary_tiers\[1\] is secondary_tiers\[0\] again \(a redis tier at redis://h:1/0\)"),
])
def test_configs_that_would_misbehave_are_refused_naming_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config({"cpu_bytes_to_use": 1, **extra})


def test_bad_flag_names_the_option_the_caller_gives():
    with pytest.raises(ValueError, match="^kv_offload host must be a byte size"):
        parse_kv_offload("host=bad", "kv_offload")


def test_tier_policies_parse_into_the_tier_spec(tmp_path):
    config = OffloadConfig.from_extra_config({
        "cpu_bytes_to_use": "1MiB", "write_policy": "write_back",
        "secondary_tiers": [
            {"type": "memory"},
            {"type": "fs", "root_dir": str(tmp_path), "write_policy": "write_through",
             "admit_after_hits": 2, "max_pending_stores": 8, "name": "shared"}]})
    local, shared = config.secondary_tiers
    assert local == TierSpec(type="memory", name="memory", options=MemoryTierOptions())
    assert (local.write_policy, local.admit_after_hits, local.max_pending_stores) == \
        (None, 0, None)
    assert shared == TierSpec(type="fs", name="shared",
                              options=FsTierOptions(root_dir=str(tmp_path)),
                              write_policy="write_through", admit_after_hits=2,
                              max_pending_stores=8)


@pytest.mark.parametrize("entry, message", [
    ({"write_policy": "back"}, "^secondary tier 'memory': write_policy must be one of "
                               r"\['write_through', 'write_back'\], got 'back'$"),
    ({"admit_after_hits": -1}, "^secondary tier 'memory': admit_after_hits must be an integer "
                               ">= 0, got -1$"),
    ({"max_pending_stores": 0}, "^secondary tier 'memory': max_pending_stores must be an "
                                "integer >= 1 or null, got 0$"),
    ({"admit_after_hit": 2}, r"^kv_connector_extra_config\.secondary_tiers\[0\]: unknown key "
                             r"'admit_after_hit'; valid keys are \['admit_after_hits', "
                             r"'max_bytes', 'max_pending_stores', 'module_path', 'name', "
                             r"'type', 'write_policy'\]$"),
])
def test_bad_tier_policy_names_the_tier_and_key(entry, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config({"cpu_bytes_to_use": 1,
                                         "secondary_tiers": [{"type": "memory", **entry}]})


def test_per_tier_policy_example_of_the_docs_parses():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "tiers.md").read_text()
    section = docs.split("### Per-tier policies", 1)[1]
    fragment = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    config = OffloadConfig.from_extra_config(
        json.loads("{" + fragment + ', "cpu_bytes_to_use": "1GiB"}'))
    disk, shared = config.secondary_tiers
    assert (config.write_policy, disk.write_policy, disk.admit_after_hits) == \
        ("write_back", None, 0)
    assert (shared.write_policy, shared.admit_after_hits, shared.max_pending_stores) == \
        ("write_through", 2, 16)


@pytest.mark.parametrize("extra, message", [
    ({"cpu_bytes_to_use": 1e30}, "^kv_connector_extra_config.cpu_bytes_to_use must be > 0 and "
                                 "below 2\\*\\*63"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "disk", "root_dir": "/x", "max_bytes": "1GiB", "num_read_threads": 100000}]},
     "^disk.num_read_threads must be an integer in \\[1, 64\\], got 100000$"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "fs", "root_dir": "/x", "num_write_threads": 65}]},
     "^fs.num_write_threads must be an integer in \\[1, 64\\], got 65$"),
])
def test_sizes_and_thread_counts_have_upper_bounds(extra, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config(extra)
