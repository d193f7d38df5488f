"""`--kv-transfer-config` / `kv_transfer_config`: which connector to run and how.

The user's dict has vLLM's shape. It is parsed once here into a frozen `KVTransferConfig`,
before anything heavy is imported or loaded. The built-in connectors whose options import no
torch (`OffloadingConnector`, `MultiConnector`) have their `kv_connector_extra_config` parsed
here too, into `KVTransferConfig.options`, which their halves use as is. Other connectors
(`ExampleConnector`, whose module imports torch, and out-of-tree ones) parse the dict into their
own dataclass with `parse_options` when they are created: still at start-up, not mid-run, but
after the model loads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvtier.common.options import parse_options

KVRole = Literal["kv_both", "kv_producer", "kv_consumer"]
KVLoadFailurePolicy = Literal["recompute", "fail"]

_ROLES: tuple[str, ...] = get_args(KVRole)
_FAILURE_POLICIES: tuple[str, ...] = get_args(KVLoadFailurePolicy)
_EXAMPLE = ('{"kv_connector": "OffloadingConnector", '
            '"kv_connector_extra_config": {"cpu_bytes_to_use": "4GiB"}}')


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector to load, its role, and what to do when a load goes wrong."""

    kv_connector: str
    kv_role: KVRole = "kv_both"
    # Connector-specific options as the user wrote them (`to_dict` gives them back); `options`
    # is their parsed form where the connector is known here. Left out of the hash: a dict is
    # unhashable and the other fields identify the config.
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, hash=False)
    # A dotted module name; when set, `kv_connector` names a class in that module.
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    # Deadline for one asynchronous load; a load that misses it counts as failed.
    kv_load_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self._check_fields()
        # Not a dataclass field: derived from kv_connector_extra_config, so it takes no part in
        # __init__, equality, hashing or to_dict.
        object.__setattr__(self, "_options", _parse_connector_options(self))

    @property
    def options(self) -> Any:
        """`kv_connector_extra_config` as the connector's typed options (OffloadConfig for the
        OffloadingConnector, the child configs for the MultiConnector), parsed once at
        construction; None for connectors that parse the dict themselves."""
        return self._options

    def _check_fields(self) -> None:
        _require(isinstance(self.kv_connector, str) and self.kv_connector != "",
                 "kv_connector", "must be a non-empty connector name", self.kv_connector)
        _require(self.kv_role in _ROLES, "kv_role", f"must be one of {list(_ROLES)}",
                 self.kv_role)
        _require(isinstance(self.kv_connector_extra_config, dict), "kv_connector_extra_config",
                 "must be a JSON object (dict)", self.kv_connector_extra_config)
        _require(self.kv_connector_module_path is None
                 or (isinstance(self.kv_connector_module_path, str)
                     and self.kv_connector_module_path != ""),
                 "kv_connector_module_path", "must be a dotted module name or null",
                 self.kv_connector_module_path)
        _require(self.kv_load_failure_policy in _FAILURE_POLICIES, "kv_load_failure_policy",
                 f"must be one of {list(_FAILURE_POLICIES)}", self.kv_load_failure_policy)
        timeout = self.kv_load_timeout_s
        _require(isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                 and timeout > 0, "kv_load_timeout_s", "must be a number of seconds > 0",
                 timeout)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVTransferConfig:
        if not isinstance(raw, Mapping):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {raw!r}")
        if "kv_connector" not in raw:
            raise ValueError("kv_transfer_config.kv_connector is required "
                             "(e.g. {\"kv_connector\": \"ExampleConnector\"})")
        return parse_options(cls, raw, "kv_transfer_config")

    @classmethod
    def from_json(cls, text: str, where: str = "kv_transfer_config") -> KVTransferConfig:
        """`where` names the option in the error for text that is not JSON (the CLI passes
        "--kv-transfer-config")."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON ({exc}): {text!r}; write it like "
                             f"{_EXAMPLE}") from exc
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The plain-dict form `from_dict` accepts (for JSON, child configs, subprocesses)."""
        return dataclasses.asdict(self)

    @property
    def is_producer(self) -> bool:
        """This instance saves KV for others."""
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_consumer(self) -> bool:
        """This instance loads KV that others saved."""
        return self.kv_role in ("kv_both", "kv_consumer")


def _parse_connector_options(config: KVTransferConfig) -> Any:
    """The typed options of a built-in connector whose options import no torch, else None."""
    if config.kv_connector_module_path is not None:
        return None
    if config.kv_connector == "OffloadingConnector":
        from kvtier.offload.config import OffloadConfig
        return OffloadConfig.from_extra_config(config.kv_connector_extra_config)
    if config.kv_connector == "MultiConnector":
        # Each child is a KVTransferConfig itself: its own options are parsed now, too.
        from kvtier.connector.multi import child_configs
        return tuple(child_configs(config))
    return None


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_config.{name} {rule}, got {value!r}")
