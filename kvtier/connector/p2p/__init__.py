"""P2PConnector: prefill/decode disaggregation over the transfer engine (kvtier/transport).

A producer (`kv_role: kv_producer`) computes a prompt and sends the KV of its prompt's full
blocks to the consumer its kv_transfer_params name, one transfer per layer (`layout.py`). With
push "request" it sends when the request finishes; with push "layer" it copies each layer's
blocks to the host as the forward pass writes them and sends each layer during the step that
computes the prompt's last full block. Either way the blocks stay allocated (`request_finished`
returns delay_free=True) until the send ends, successfully or not (a consumer that never asks
fails the send after `send_timeout_s`). A consumer (`kv_role: kv_consumer`) given the
kv_transfer_params the producer returned loads that KV asynchronously (WAITING_FOR_REMOTE_KVS)
and computes only the rest; a load that fails or misses `kv_load_timeout_s` is recomputed per
`kv_load_failure_policy`.

    producer request  kv_transfer_params={"transfer_id": T, "consumer_address": A}
    producer returns  kv_transfer_params={"transfer_id": T, "num_tokens": N, "block_hash": H,
                                          "kv_namespace": S}
    consumer request  the same

H ("ALGO:HEX"; absent when N is 0) is the producer's hash of its last sent block: a consumer
that hashes blocks the same way and whose own hash there differs (another LoRA adapter under the
same name, another cache_salt or prompt) takes the transfer and drops it (the producer's blocks
are freed at once) and computes the prompt itself, rather than cache KV that is not its own.
S (hex; absent when N is 0) is the producer's KVIdentity namespace: a consumer that stores KV
another way (another model, dtype, --kv-cache-dtype or block size), whose transport would refuse
the producer anyway, computes the prompt at once instead of waiting for a load that cannot come.

A is the consumer's transfer engine address (`tcp://host:port`, its extra config `bind_host`
and `port`); T is unique per consumer (the router picks it). Both engines must have the same
KVIdentity namespace and, when $KVTIER_TRANSPORT_SECRET(_FILE) is set, the same secret.
Extra config: {"bind_host": "127.0.0.1", "port": 0, "send_timeout_s": 60.0, "push": "layer",
"transport": "zmq"} ("mooncake": Mooncake's transfer engine, see docs/transport.md). Models with
one KV cache group only.
"""

from kvtier.connector.base import KVConnectorBase
from kvtier.connector.p2p.scheduler import P2PConnectorScheduler
from kvtier.connector.p2p.worker import P2PConnectorWorker


class P2PConnector(KVConnectorBase):
    scheduler_cls = P2PConnectorScheduler
    worker_cls = P2PConnectorWorker


__all__ = ["P2PConnector", "P2PConnectorScheduler", "P2PConnectorWorker"]
