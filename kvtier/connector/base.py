"""The KV connector contract: one small interface per role.

A connector moves KV between this engine's paged cache and somewhere else (files, a host/disk
tier cascade, another instance). It has two halves that never share memory:

* the scheduler half decides *what* to load or save and tells the worker through a
  `KVConnectorMetadata` built once per step;
* the worker half moves the bytes around each forward pass and reports back through a
  `KVConnectorOutput`, which carries the connector's own `KVConnectorReport`.

Those two messages are plain data, so the halves may live in different processes. A resource
both halves use (a shared memory area) is made once by `KVConnectorBase.create_shared` and
handed to each half in its `ConnectorContext`.

A connector is named by a `KVConnectorBase` subclass that points at its two halves; the registry
(or `kv_connector_module_path`) resolves the name to that class.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvtier.connector.config import KVTransferConfig
    from kvtier.kv import KVCacheBlocks, KVIdentity, Request

# How long an idle engine sleeps between steps when its connector cannot tell when a transfer
# ends (`KVConnectorWorker.wait_for_transfers`).
TRANSFER_POLL_S = 0.0005


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step. Connectors subclass it."""


@dataclass
class KVConnectorReport:
    """What a worker half tells its own scheduler half beyond the fields every connector shares
    (e.g. which of its copies finished). Connectors subclass it; plain data."""


@dataclass
class KVConnectorOutput:
    """What the worker half reports back after one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    # Block ids whose load failed (bad data, missed deadline); the scheduler applies
    # `kv_load_failure_policy` to the requests that own them.
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: dict[str, float] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    # The worker half's `build_connector_report()`, for its scheduler half.
    connector_report: KVConnectorReport | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.stats or self.events or self.connector_report is not None)


@dataclass(frozen=True)
class ConnectorContext:
    """Facts about the engine a connector may need, fixed at start-up."""

    block_size: int
    num_layers: int
    # What the engine's KV bytes depend on (weights, dtype, block size, layout, spec kinds). A
    # connector that writes KV in a shape of its own adds its facts (`kv_identity.extended`).
    kv_identity: KVIdentity
    # Engine metrics registry (kvtier.engine.metrics.MetricsRegistry) or None.
    metrics: Any = None
    # The device KV cache geometry (kvtier.kv.KVCacheConfig: groups, layer names, specs) or
    # None; connectors that lay KV out in their own memory (offloading) need it.
    kv_cache_config: Any = None
    # What `KVConnectorBase.create_shared` made for this engine (the same object in both
    # halves), or None.
    shared: Any = None
    # The longest sequence a request may have (tokens), or None when not known.
    max_model_len: int | None = None
    # The engine publishes KV events (`take_events` is read): a connector that makes events
    # only for publishing skips that work when False (the engine then drops what it returns).
    kv_events: bool = False
    # How the engine hashes blocks (kvtier.kv.hashing): `Request.block_hashes` are of this kind.
    hash_algo: str = "sha256_cbor"

    @property
    def namespace(self) -> bytes:
        """Prefixes every key written outside the process: the digest of `kv_identity`."""
        return self.kv_identity.namespace

    def require_one_kv_cache_group(self, connector: str) -> None:
        """ValueError at start-up for a model with several KV cache groups (a hybrid, or mixed
        attention windows), for a connector that moves one group's blocks only: found at a
        request's allocation instead, it would fail the step of every request batched with
        it."""
        groups = getattr(self.kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise ValueError(f"{connector} supports models with one KV cache group (every layer "
                             f"the same attention type); this model has {len(groups)}: use "
                             "OffloadingConnector, or serve it without a KV connector")


class KVConnectorScheduler(ABC):
    """Scheduler half. Lives in the scheduler; sees requests and block ids, never tensors."""

    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        self.config = config
        self.context = context

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the local hit that this connector can provide, and whether the load is
        asynchronous. `None` means "cannot tell yet": the scheduler skips the request this step
        and asks again next step. Must have no side effects."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for the request: remember which ones to fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves for the worker half; resets per-step state."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker half's report for the last step (its own part in
        `output.connector_report`). Also called once at shutdown, before `shutdown`, with the
        report the worker half made after it stopped."""

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished. Returning True keeps its blocks allocated until the worker lists
        the request in `finished_sending`. The dict is returned to the client as
        `kv_transfer_params`."""
        return False, None

    def take_events(self) -> Iterable[Any]:
        """KV events since the last call, in the wire schema (kvtier.events: BlockStored /
        BlockRemoved named by 64-bit block hashes, with medium and locality); the server
        publishes them beside the device cache's."""
        return ()

    def shutdown(self) -> None:
        """Called once when the engine stops, after the worker half's last report: finish
        writes that keep this instance's work (with a deadline), stop background threads."""


class KVConnectorWorker(ABC):
    """Worker half. Lives next to the model; moves bytes between the paged KV cache and elsewhere.

    The per-layer hooks are called from inside the model's attention layers only when a
    connector is configured, so an engine without one pays nothing.
    """

    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        self.config = config
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The paged KV tensors, by layer name: (2, num_blocks, block_size, kv_heads, head_dim)."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata:
        assert self._metadata is not None, "no connector metadata bound for this step"
        return self._metadata

    @abstractmethod
    def start_load_kv(self, forward_context: Any) -> None:
        """Start this step's loads; do not wait for them."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV for this step has arrived (layer-wise pipelining)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """`layer_name`'s KV for this step was written into the paged cache: start saving it."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the paged blocks they read."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) request ids since the last call."""
        return set(), set()

    def wait_for_transfers(self, timeout_s: float) -> None:
        """Called after a step with nothing to compute (every live request waits on a
        transfer): return once a transfer may have ended, `timeout_s` at the latest; the next
        step's `get_finished` reports it. The default cannot tell when that is, so it sleeps
        TRANSFER_POLL_S, handing the cores to the transfer threads rather than spinning on
        them. A connector that waits longer must end its wait on `interrupt_wait`."""
        time.sleep(min(timeout_s, TRANSFER_POLL_S))

    def interrupt_wait(self) -> None:
        """End the `wait_for_transfers` under way (or the next one) at once: the engine has a
        new command. Called from any thread. The default's sleeps are too short to matter."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_stats(self) -> dict[str, float]:
        return {}

    def take_events(self) -> Iterable[Any]:
        return ()

    def build_connector_report(self) -> KVConnectorReport | None:
        """This connector's own report for its scheduler half, once per step after
        `get_finished` (in `KVConnectorOutput.connector_report`); None when there is nothing
        to say. Called once more after `shutdown`, for the work that ended while stopping."""
        return None

    def shutdown(self) -> None:
        """Called once when the engine stops: end or give up in-flight transfers within a
        deadline and stop background threads. The engine then asks for one last report."""


class KVConnectorBase:
    """Names a connector. `kv_connector` in the transfer config resolves to a subclass."""

    scheduler_cls: ClassVar[type[KVConnectorScheduler]]
    worker_cls: ClassVar[type[KVConnectorWorker]]

    @classmethod
    def create_shared(cls, config: KVTransferConfig, context: ConnectorContext) -> Any:
        """A resource both halves use, made once per engine before either half; it reaches
        them as `context.shared`. None (the default) when the halves share nothing. Halves
        in different processes need something that crosses processes (a shared-memory name)."""
        return None

    @classmethod
    def create(cls, role: KVConnectorRole, config: KVTransferConfig,
               context: ConnectorContext) -> KVConnectorScheduler | KVConnectorWorker:
        half = cls.scheduler_cls if role is KVConnectorRole.SCHEDULER else cls.worker_cls
        return half(config, context)
