"""`--kv-transfer-config` / `kv_transfer_config`: which connector to run and how.

The user's dict has vLLM's shape. It is parsed once here into a frozen `KVTransferConfig`;
the connector's own options (`kv_connector_extra_config`) are parsed by that connector into its
own typed dataclass with `parse_options`, so a misspelt key fails at start-up, not mid-run.
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


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector to load, its role, and what to do when a load goes wrong."""

    kv_connector: str
    kv_role: KVRole = "kv_both"
    # Connector-specific options; the connector parses them (see `parse_options`).
    # Left out of the hash: a dict is unhashable and the other fields identify the config.
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, hash=False)
    # A dotted module name; when set, `kv_connector` names a class in that module.
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    # Deadline for one asynchronous load; a load that misses it counts as failed.
    kv_load_timeout_s: float = 30.0

    def __post_init__(self) -> None:
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
    def from_json(cls, text: str) -> KVTransferConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_transfer_config is not valid JSON ({exc}): {text!r}") from exc
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


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_config.{name} {rule}, got {value!r}")
