"""Out-of-tree connectors for the tests, loaded through `kv_connector_module_path`.

The tests name it by its full module path, PLUGINS (connector_testing.py): it imports the same
way in pytest and in the subprocesses the end-to-end tests start from the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.connector import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorScheduler,
    KVConnectorWorker,
    parse_options,
)
from kvtier.connector.example import (
    ExampleConnectorMetadata,
    ExampleConnectorScheduler,
    ExampleConnectorWorker,
)

# One entry per forward step the RecordingConnector saw: its (hook, layer name) calls in order.
RECORDED_STEPS: list[dict[str, Any]] = []


class FaultyLoadWorker(ExampleConnectorWorker):
    """Loads like ExampleConnector, then scribbles over every second loaded block of each request
    and reports it invalid: output can only match a clean run if the engine recomputes it."""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self._bad_blocks: dict[str, int] = {}
        self._reported: set[int] = set()
        self._num_reported = context.metrics.counter(
            "kvtier_test:blocks_reported_invalid", "Blocks FaultyLoadConnector reported invalid")

    def start_load_kv(self, forward_context: Any) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, ExampleConnectorMetadata)
        self._bad_blocks.update({req_id: blocks[1].block_id
                                 for req_id, blocks in meta.loads.items() if len(blocks) > 1})
        super().start_load_kv(forward_context)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        for req_id in recving & self._bad_blocks.keys():
            block_id = self._bad_blocks.pop(req_id)
            for cache in self.kv_caches.values():
                cache[:, block_id].fill_(1e4)
            self._reported.add(block_id)
            self._num_reported.inc()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        reported, self._reported = self._reported, set()
        return super().get_block_ids_with_load_errors() | reported


class FaultyLoadConnector(KVConnectorBase):
    scheduler_cls = ExampleConnectorScheduler
    worker_cls = FaultyLoadWorker


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    num_scheduled_tokens: int = 0
    step: int = 0


class RecordingScheduler(KVConnectorScheduler):
    """Never has KV to offer; numbers the steps so the worker can tell them apart."""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self._step = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> RecordingMetadata:
        self._step += 1
        return RecordingMetadata(scheduler_output.total_num_scheduled_tokens, self._step)


class RecordingWorker(KVConnectorWorker):
    """Writes down every layer hook call of a step into RECORDED_STEPS when the step ends."""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self._calls: list[tuple[str, str]] = []

    def start_load_kv(self, forward_context: Any) -> None:
        self._calls = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        self._calls.append(("save_kv_layer", layer_name))

    def clear_connector_metadata(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, RecordingMetadata)
        RECORDED_STEPS.append({"step": meta.step, "num_scheduled_tokens":
                               meta.num_scheduled_tokens, "calls": self._calls})
        super().clear_connector_metadata()


class RecordingConnector(KVConnectorBase):
    scheduler_cls = RecordingScheduler
    worker_cls = RecordingWorker


class NotAConnector:
    scheduler_cls = RecordingScheduler
    worker_cls = RecordingWorker


class HalfMissingConnector(KVConnectorBase):
    scheduler_cls = RecordingScheduler
    worker_cls = RecordingScheduler  # wrong half on purpose


class UndecidedScheduler(RecordingScheduler):
    """Like an offloading tier still promoting a chunk: always "ask me again next step"."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return None, False


class UndecidedConnector(KVConnectorBase):
    scheduler_cls = UndecidedScheduler
    worker_cls = RecordingWorker


@dataclass(frozen=True)
class SendingOptions:
    # How many get_finished calls a send takes after the request finished.
    send_steps: int = 1


class SendingScheduler(RecordingScheduler):
    """A producer: every finished request's blocks stay allocated until its send is done."""

    def request_finished(self, request, block_ids):
        return True, {"sent_by": self.config.kv_connector_extra_config}


class SendingWorker(RecordingWorker):
    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self.options = parse_options(SendingOptions, config.kv_connector_extra_config, "Sending")
        self._steps_left: dict[str, int] = {}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for req_id in finished_req_ids:
            self._steps_left[req_id] = self.options.send_steps
        done = set()
        for req_id in list(self._steps_left):
            self._steps_left[req_id] -= 1
            if self._steps_left[req_id] == 0:
                del self._steps_left[req_id]
                done.add(req_id)
        return done, set()


class SendingConnector(KVConnectorBase):
    scheduler_cls = SendingScheduler
    worker_cls = SendingWorker


@dataclass(frozen=True)
class TaggedOptions:
    tag: str = ""


@dataclass
class TaggedReport(KVConnectorReport):
    tag: str = ""
    # The worker's own count of the reports it built, and the shared object it was handed.
    number: int = 0
    shared_id: int = 0


class TaggedScheduler(RecordingScheduler):
    """Keeps every report it is handed."""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self.reports: list[Any] = []

    def update_connector_output(self, output) -> None:
        self.reports.append(output.connector_report)


class TaggedWorker(RecordingWorker):
    """Reports its tag, a running number and which shared object it got."""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self.tag = parse_options(TaggedOptions, config.kv_connector_extra_config, "Tagged").tag
        self.number = 0

    def build_connector_report(self) -> TaggedReport:
        self.number += 1
        return TaggedReport(self.tag, self.number, id(self.context.shared))


class TaggedConnector(KVConnectorBase):
    scheduler_cls = TaggedScheduler
    worker_cls = TaggedWorker

    @classmethod
    def create_shared(cls, config, context) -> dict[str, str]:
        return {"made_for": config.kv_connector_extra_config["tag"]}
