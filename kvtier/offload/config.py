"""Offloading options: the `kv_connector_extra_config` of `OffloadingConnector` and the
one-flag `--kv-offload`.

Both forms end up in one frozen `OffloadConfig`, parsed once with the engine's config (see
kvtier.connector.config) and handed to the connector as is. The flag form
(`host=4GiB,disk=/var/cache/kvtier:50GiB`) is expanded by `parse_kv_offload` into the JSON form,
so the two take one code path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from kvtier.common.options import is_positive_int, parse_options, require
from kvtier.common.sizes import parse_size

EvictionPolicyName = Literal["lru", "arc"]
WritePolicyName = Literal["write_through", "write_back"]
SPEC_NAME = "TieringOffloadingSpec"
CONNECTOR_NAME = "OffloadingConnector"
_WHERE = "kv_connector_extra_config"


# Keys of a secondary_tiers entry that the tiering manager reads; the rest are the tier's own.
TIER_POLICY_KEYS = ("write_policy", "admit_after_hits", "max_pending_stores")


@dataclass(frozen=True)
class TierSpec:
    """One secondary tier: its `type`, its own parsed options, a unique label for metrics, and
    the policies the tiering manager applies to it (so a remote tier can differ from a local
    one)."""

    type: str
    name: str
    # The tier class's own frozen options dataclass (or the raw dict for a tier without one).
    options: Any
    module_path: str | None = None
    # When chunks from the device go on to this tier; None: the connector's write_policy.
    write_policy: WritePolicyName | None = None
    # Store a chunk on this tier only once it has been loaded from host memory into the device
    # this many times (0: every chunk). Keeps one-off prompts off a slow or paid tier.
    admit_after_hits: int = 0
    # Backpressure: with this many stores in flight the tier gets no new ones; they are dropped
    # (counted) rather than holding host slots while it catches up. None: no limit.
    max_pending_stores: int | None = None

    def __post_init__(self) -> None:
        where = f"secondary tier {self.name!r}:"
        require(self.write_policy is None or self.write_policy in get_args(WritePolicyName),
                f"{where} write_policy", f"must be one of {list(get_args(WritePolicyName))}",
                self.write_policy)
        require(isinstance(self.admit_after_hits, int) and not isinstance(
            self.admit_after_hits, bool) and self.admit_after_hits >= 0,
                f"{where} admit_after_hits", "must be an integer >= 0", self.admit_after_hits)
        require(self.max_pending_stores is None or is_positive_int(self.max_pending_stores),
                f"{where} max_pending_stores", "must be an integer >= 1 or null",
                self.max_pending_stores)


@dataclass(frozen=True)
class OffloadConfig:
    """What `OffloadingConnector` reads from `kv_connector_extra_config`."""

    cpu_bytes_to_use: int
    spec_name: str = SPEC_NAME
    blocks_per_chunk: int = 1
    eviction_policy: EvictionPolicyName = "lru"
    # Offload only the prompt's blocks; False also offloads the blocks decoding fills (a
    # conversation's next turn starts with them).
    offload_prompt_only: bool = False
    # A chunk is stored only once this many requests have contained it (1: always store).
    store_threshold: int = 1
    # Deadline for one tier job (promotion or cascade store); late jobs count as failed.
    tier_job_timeout_s: float = 30.0
    # When a chunk from the device goes on to the secondary tiers: write_through as soon as it
    # is in host memory; write_back only when the host tier runs short of clean slots (and at
    # shutdown), so a working set that fits the host writes nothing.
    write_policy: WritePolicyName = "write_through"
    secondary_tiers: tuple[TierSpec, ...] = field(default=())
    # A file holding the secret that authenticates the chunks written to secondary tiers
    # (offload/chunk_format.py); None: $KVTIER_CHUNK_SECRET_FILE or $KVTIER_CHUNK_SECRET if set.
    secret_file: str | None = None

    def __post_init__(self) -> None:
        require(self.spec_name in (SPEC_NAME, _CPU_SPEC_NAME), f"{_WHERE}.spec_name",
                f"must be {SPEC_NAME!r} (or vLLM's {_CPU_SPEC_NAME!r}: the same, host memory "
                "first)", self.spec_name)
        # Below 2**63: buffer sizes are signed 64-bit (a larger one overflows in numpy or mmap).
        # The engine also bounds it by the machine's memory (kvtier.config); the planner sizes
        # host tiers of other machines.
        require(0 < self.cpu_bytes_to_use < 2**63, f"{_WHERE}.cpu_bytes_to_use",
                "must be > 0 and below 2**63 (the host tier's byte budget, e.g. \"4GiB\")",
                self.cpu_bytes_to_use)
        require(is_positive_int(self.blocks_per_chunk), f"{_WHERE}.blocks_per_chunk",
                "must be an integer >= 1", self.blocks_per_chunk)
        require(self.eviction_policy in get_args(EvictionPolicyName),
                f"{_WHERE}.eviction_policy", f"must be one of {list(get_args(EvictionPolicyName))}",
                self.eviction_policy)
        require(isinstance(self.offload_prompt_only, bool), f"{_WHERE}.offload_prompt_only",
                "must be true or false", self.offload_prompt_only)
        require(is_positive_int(self.store_threshold), f"{_WHERE}.store_threshold",
                "must be an integer >= 1 (or 0, vLLM's off: the same as 1)",
                self.store_threshold)
        require(isinstance(self.tier_job_timeout_s, (int, float))
                and not isinstance(self.tier_job_timeout_s, bool) and self.tier_job_timeout_s > 0,
                f"{_WHERE}.tier_job_timeout_s", "must be a number of seconds > 0",
                self.tier_job_timeout_s)
        require(self.write_policy in get_args(WritePolicyName), f"{_WHERE}.write_policy",
                f"must be one of {list(get_args(WritePolicyName))}", self.write_policy)
        require(self.secret_file is None or (isinstance(self.secret_file, str)
                                             and self.secret_file != ""),
                f"{_WHERE}.secret_file", "must be a file path", self.secret_file)

    @classmethod
    def from_extra_config(cls, raw: Mapping[str, Any]) -> OffloadConfig:
        """Parse the user's dict; unknown keys and bad values raise ValueError naming them."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{_WHERE} must be a JSON object, got {raw!r}")
        values = dict(raw)
        if "block_size" in values:
            raise ValueError(f"{_WHERE}.block_size: kvtier sizes chunks in device blocks: set "
                             "blocks_per_chunk (vLLM's block_size 64 with 16-token device "
                             "blocks is blocks_per_chunk 4)")
        if values.get("store_threshold") == 0 and values["store_threshold"] is not False:
            values["store_threshold"] = 1  # vLLM's 0: store at once, as 1 does here
        if "cpu_bytes_to_use" in values:
            values["cpu_bytes_to_use"] = parse_size(values["cpu_bytes_to_use"],
                                                    f"{_WHERE}.cpu_bytes_to_use")
        tiers = values.pop("secondary_tiers", [])
        require(isinstance(tiers, (list, tuple)), f"{_WHERE}.secondary_tiers",
                "must be a list of tier objects", tiers)
        values["secondary_tiers"] = _parse_tiers(tiers)
        return parse_options(cls, values, _WHERE)


def _parse_tiers(raw_tiers: list[Any] | tuple[Any, ...]) -> tuple[TierSpec, ...]:
    # Imported here: the tier registry imports tier option classes, which import this module's
    # helpers; a module-level import would be circular.
    from kvtier.offload.tiers.registry import parse_tier_options

    specs: list[TierSpec] = []
    places: dict[tuple[str, Any], int] = {}
    for index, raw in enumerate(raw_tiers):
        where = f"{_WHERE}.secondary_tiers[{index}]"
        require(isinstance(raw, Mapping) and isinstance(raw.get("type"), str), where,
                "must be an object with a string \"type\"", raw)
        place = (raw["type"], _place(raw))
        if place[1] is not None and place in places:
            raise ValueError(f"{where} is secondary_tiers[{places[place]}] again (a {raw['type']} "
                             f"tier at {place[1]}): every chunk would be written there twice; "
                             "list each tier once")
        places[place] = index
        name = raw.get("name")
        require(name is None or (isinstance(name, str) and name not in ("", "host")
                                 and name not in {spec.name for spec in specs}),
                f"{where}.name", "must be a string naming this tier alone (not \"host\", not "
                "another tier's)", name)
        common = ("type", "module_path", "name", *TIER_POLICY_KEYS)
        options = {k: v for k, v in raw.items() if k not in common}
        module_path = raw.get("module_path")
        name = raw.get("name") or _unique_name(raw["type"], specs)
        parsed = parse_tier_options(raw["type"], module_path, options, where, common)
        policies = {k: raw[k] for k in TIER_POLICY_KEYS if k in raw}
        specs.append(TierSpec(type=raw["type"], name=name, options=parsed,
                              module_path=module_path, **policies))
    return tuple(specs)


def _place(raw: Mapping[str, Any]) -> Any:
    """Where a tier keeps its chunks (a directory, a store URL, a bucket and prefix), or None
    when its options do not say; spelled one way, so that two spellings of one place compare
    equal."""
    if isinstance(raw.get("root_dir"), str):
        return os.path.realpath(raw["root_dir"])
    if isinstance(raw.get("url"), str):
        return _url_place(raw["url"])
    if isinstance(raw.get("bucket"), str):
        prefix = raw.get("prefix", "kvtier")
        return f"s3://{raw['bucket']}/{prefix.strip('/') if isinstance(prefix, str) else prefix}"
    return None


def _url_place(url: str) -> str:
    """A redis tier's `url` without what does not change the server: the host's case, the
    default port, database 0 (which a cluster's URL leaves out). Other URLs as given."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("redis") or not parts.hostname:
        return url
    try:
        port = parts.port or 6379
    except ValueError:
        return url  # refused by the tier's options, naming the port
    database = parts.path.strip("/") or ("" if parts.scheme.endswith("+cluster") else "0")
    return f"{parts.scheme}://{parts.hostname}:{port}/{database}".rstrip("/")


def _unique_name(tier_type: str, earlier: list[TierSpec]) -> str:
    taken = {spec.name for spec in earlier}
    if tier_type not in taken:
        return tier_type
    index = 1
    while f"{tier_type}{index}" in taken:
        index += 1
    return f"{tier_type}{index}"


_FLAG_KEYS = "host, disk, fs, obj, redis, p2p, p2p_listen, policy, blocks_per_chunk, write"
# Flag keys that set one value: given twice, which one was meant is not known.
_ONCE_KEYS = ("host", "p2p", "p2p_listen", "policy", "blocks_per_chunk", "write")
# The smallest byte budget a size after a tier's ':' may give: a bare number is bytes, and
# "fs=/data/2024:01" is more likely a directory than a 1-byte budget. (A budget that holds no
# chunk is refused when the tier starts.)
_MIN_TIER_BYTES = 4096
_CPU_SPEC_NAME = "CPUOffloadingSpec"
_FLAG_EXAMPLE = "host=4GiB,disk=/var/cache/kvtier:50GiB"


def parse_kv_offload(flag: str, where: str = "--kv-offload") -> dict[str, Any]:
    """`host=4GiB,disk=/var/cache/kvtier:50GiB` -> the `kv_connector_extra_config` of the
    OffloadingConnector it stands for. `where` names the option in errors ("--kv-offload" on the
    command line, "kv_offload" for LLM()).

    `host` (required) is the host tier's byte budget. `disk=DIR:SIZE` adds a disk tier (this
    instance's slot file of SIZE bytes in DIR), `fs=DIR[:SIZE]` an fs tier (a file per chunk,
    shared by the instances that mount DIR; SIZE is its byte budget); both may repeat, each at
    its own DIR (a size after the last ':' is at least 4KiB).
    `obj=s3://BUCKET/PREFIX[:SIZE]` adds an obj tier (an object per chunk in an S3-compatible
    bucket, configured by the standard AWS settings; SIZE bounds what this instance writes),
    `redis=redis://HOST:PORT/DB` a redis tier (`rediss://` for TLS, `redis+cluster://HOST:PORT`
    for a cluster; the password comes from $REDIS_PASSWORD).
    `p2p=HOST:PORT[;HOST:PORT]` adds a p2p tier that asks those kvtier instances' host tiers,
    `p2p_listen=HOST:PORT` makes this instance serve its host tier to them (one p2p tier takes
    both).
    `policy=lru|arc`, `blocks_per_chunk=N` and `write=through|back` (the write policy) are
    optional. Each value is checked here, so an error names the flag's own key; per-tier
    policies need the JSON form. `OffloadConfig.from_extra_config` parses the result.
    """
    if not isinstance(flag, str) or not flag.strip():
        raise ValueError(f"{where}: expected comma-separated key=value pairs such as "
                         f"{_FLAG_EXAMPLE!r} (keys: {_FLAG_KEYS}), got {flag!r}")
    extra: dict[str, Any] = {"spec_name": SPEC_NAME, "secondary_tiers": []}
    seen: set[str] = set()
    for part in flag.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not value:
            raise ValueError(f"{where}: expected comma-separated key=value pairs such as "
                             f"{_FLAG_EXAMPLE!r} (keys: {_FLAG_KEYS}), got {part!r}")
        key = key.strip()
        if key in _ONCE_KEYS and key in seen:
            raise ValueError(f"{where}: {key}= is given twice; give it once")
        seen.add(key)
        _apply_flag_pair(extra, key, value.strip(), where)
    if "cpu_bytes_to_use" not in extra:
        raise ValueError(f"{where}: 'host=SIZE' is required (e.g. {_FLAG_EXAMPLE}): every "
                         f"offload passes through host memory")
    return extra


def _apply_flag_pair(extra: dict[str, Any], key: str, value: str, where: str) -> None:
    if key == "host":
        extra["cpu_bytes_to_use"] = parse_size(value, f"{where} host")
        require(extra["cpu_bytes_to_use"] > 0, f"{where} host",
                "must be at least one byte (a bare number is bytes), e.g. host=4GiB", value)
    elif key == "disk":
        extra["secondary_tiers"].append(_parse_disk(value, f"{where} disk={value}"))
    elif key == "fs":
        extra["secondary_tiers"].append(_parse_fs(value, f"{where} fs={value}"))
    elif key == "obj":
        extra["secondary_tiers"].append(_parse_obj(value, f"{where} obj={value}"))
    elif key == "redis":
        extra["secondary_tiers"].append(_parse_redis(value, where))
    elif key in ("p2p", "p2p_listen"):
        tier = _p2p_tier(extra)
        if key == "p2p":
            tier["peers"] = [peer.strip() for peer in value.split(";")]
        else:
            tier["listen"] = value
    elif key == "policy":
        require(value in get_args(EvictionPolicyName), f"{where} policy",
                "must be lru or arc, e.g. policy=arc", value)
        extra["eviction_policy"] = value
    elif key == "blocks_per_chunk":
        require(value.isdigit() and int(value) >= 1, f"{where} blocks_per_chunk",
                "must be an integer >= 1, e.g. blocks_per_chunk=4", value)
        extra["blocks_per_chunk"] = int(value)
    elif key == "write":
        require(value in ("through", "back"), f"{where} write",
                "must be through or back, e.g. write=back", value)
        extra["write_policy"] = f"write_{value}"
    else:
        raise ValueError(f"{where}: unknown key {key!r}; keys are {_FLAG_KEYS}, e.g. "
                         f"{_FLAG_EXAMPLE}")


def _p2p_tier(extra: dict[str, Any]) -> dict[str, Any]:
    """The flag's one p2p tier (`p2p` and `p2p_listen` both set it up), added on first use."""
    for tier in extra["secondary_tiers"]:
        if tier["type"] == "p2p":
            return tier
    extra["secondary_tiers"].append({"type": "p2p"})
    return extra["secondary_tiers"][-1]


def _split_dir_size(value: str, where: str) -> tuple[str, int | None]:
    """(place, size in bytes or None). The size is optional and comes after the last colon,
    where it must be a size of at least 4KiB; a path may itself contain colons, as long as no
    part after one looks like a number (such a path needs the JSON form)."""
    root, sep, size = value.rpartition(":")
    if value.endswith(":"):
        raise ValueError(f"{where}: ends with ':'; write DIR or DIR:SIZE, e.g. "
                         "/var/cache/kvtier:50GiB")
    if not sep or not (size[0].isdigit() or size[0] in "+-."):
        return value, None
    if not root:
        raise ValueError(f"{where}: needs a directory or URL before ':{size}', e.g. "
                         f"/var/cache/kvtier:{size}")
    try:
        num_bytes = parse_size(size, where)
    except ValueError:
        num_bytes = -1
    if num_bytes < _MIN_TIER_BYTES:
        raise ValueError(f"{where}: the size after the last ':' ({size!r}) must be at least "
                         "4KiB, e.g. :50GiB (a bare number is bytes; a directory whose name "
                         "ends in ':' and a number needs the JSON form, --kv-transfer-config)")
    return root, num_bytes


def _parse_disk(value: str, where: str) -> dict[str, Any]:
    root, size = _split_dir_size(value, where)
    if size is None:
        raise ValueError(f"{where}: the disk tier needs a size, e.g. disk={value}:50GiB (its "
                         f"file is preallocated); for a directory without a budget, shared "
                         f"between instances, use fs={value}")
    return {"type": "disk", "root_dir": root, "max_bytes": size}


def _parse_fs(value: str, where: str) -> dict[str, Any]:
    root, size = _split_dir_size(value, where)
    if size is None:
        return {"type": "fs", "root_dir": root}
    return {"type": "fs", "root_dir": root, "max_bytes": size}


def _parse_obj(value: str, where: str) -> dict[str, Any]:
    url, size = _split_dir_size(value, where)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not url.startswith("s3://") or not bucket:
        raise ValueError(f"{where}: expected s3://BUCKET/PREFIX[:SIZE], e.g. "
                         f"obj=s3://kv-cache/llama:100GiB")
    tier: dict[str, Any] = {"type": "obj", "bucket": bucket}
    if prefix:
        tier["prefix"] = prefix
    if size is not None:
        tier["max_bytes"] = size
    return tier


def _parse_redis(value: str, where: str) -> dict[str, Any]:
    if "://" not in value:
        raise ValueError(f"{where} redis={value}: expected a URL such as redis://HOST:PORT/0, "
                         f"rediss://HOST:PORT/0 (TLS) or redis+cluster://HOST:PORT")
    return {"type": "redis", "url": value}
