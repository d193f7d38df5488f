"""A connector that moves nothing and records every worker hook call, in order (loaded by
tests through kv_connector_module_path)."""

from __future__ import annotations

from kvtier.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
)

# Worker-half calls of the last engine built with this connector, in call order.
CALLS: list[tuple] = []


class RecordingScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()


class RecordingWorker(KVConnectorWorker):
    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        CALLS.clear()
        CALLS.append(("register_kv_caches", tuple(kv_caches)))

    def bind_connector_metadata(self, metadata):
        super().bind_connector_metadata(metadata)
        CALLS.append(("bind_connector_metadata",))

    def start_load_kv(self, forward_context):
        CALLS.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name):
        CALLS.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata):
        CALLS.append(("save_kv_layer", layer_name))

    def wait_for_save(self):
        CALLS.append(("wait_for_save",))

    def get_finished(self, finished_req_ids):
        CALLS.append(("get_finished", tuple(sorted(finished_req_ids))))
        return set(), set()

    def get_block_ids_with_load_errors(self):
        CALLS.append(("get_block_ids_with_load_errors",))
        return set()

    def get_stats(self):
        CALLS.append(("get_stats",))
        return {"recording_steps": 1.0}

    def take_events(self):
        CALLS.append(("take_events",))
        return ()

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        CALLS.append(("clear_connector_metadata",))


class RecordingConnector(KVConnectorBase):
    scheduler_cls = RecordingScheduler
    worker_cls = RecordingWorker
