"""P2PConnector end to end on a tiny random Llama: one engine prefills, another decodes with the
KV it received over the transport, token for token as HF's greedy generation, with the producer
pushing the whole request once it finished or each layer as the forward pass computes it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier import LLM
from kvtier.kv import Request
from kvtier.kv.hashing import make_block_hasher
from kvtier.transport import TransportError
from tests.transport.p2p_helpers import (
    BLOCK_SIZE,
    GREEDY,
    MAX_TOKENS,
    PREFILL,
    engine_pair,
    hand_over,
    loaded_tokens,
    stepping,
)
from tests.transport.p2p_helpers import run_request as _run
from tests.transport.transport_helpers import UNAVAILABLE


def _drain(llm: LLM) -> None:
    """Step until held blocks are freed (the producer's sends ended)."""
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.check_invariants()


def _metric_reaches(llm: LLM, name: str, value: float, timeout_s: float = 10.0) -> bool:
    """Step the engine until metric `name` reaches `value`: the worker reports a failed load
    at its own deadline, which may come a step after the scheduler gave up on the load."""
    deadline = time.monotonic() + timeout_s
    while llm.get_metrics().get(name, 0.0) < value and time.monotonic() < deadline:
        llm.engine.step()
    return llm.get_metrics().get(name, 0.0) == value


@pytest.fixture
def engines(model):
    with engine_pair(model[0]) as pair:
        yield pair


def test_decode_on_consumer_with_producer_kv_matches_hf(model, engines):
    _, prompts, expected = model
    producer, consumer = engines
    prefills, decodes = hand_over(producer, consumer, prompts)
    assert [{k: v for k, v in p.kv_transfer_params.items() if k != "block_hash"}
            for p in prefills] == [
        {"transfer_id": f"t{i}", "num_tokens": len(prompt) // BLOCK_SIZE * BLOCK_SIZE,
         "kv_namespace": producer.engine.runtime.namespace.hex()}
        for i, prompt in enumerate(prompts)]
    # The hash of the last block sent, which the consumer checks against its own.
    hasher = make_block_hasher(BLOCK_SIZE)
    assert [p.kv_transfer_params["block_hash"] for p in prefills] == [
        "sha256_cbor:" + Request("r", prompt, block_hasher=hasher)
        .block_hashes[len(prompt) // BLOCK_SIZE - 1].hex() for prompt in prompts]
    start = time.monotonic()
    _drain(producer)
    # Every send ended well before send_timeout_s (5 s), the one of the prompt the consumer
    # found in its own prefix cache too: the consumer took that transfer and dropped it.
    assert time.monotonic() - start < 4.5
    assert producer.get_metrics()["kvtier:p2p_connector_requests_sent"] == len(prompts)
    # (19, 16, 13, 23, 6 tokens) -> 4, 3, -, 5, 1 blocks; the third found locally.
    assert consumer.get_metrics()["kvtier:p2p_connector_blocks_loaded"] == 13
    _drain(consumer)
    assert [d.outputs[0].token_ids for d in decodes] == expected
    # Every full block before the last token came from the producer (or, for the prompt that
    # shares its first blocks with an earlier one, from the consumer's own prefix cache).
    assert [d.num_cached_tokens for d in decodes] == [loaded_tokens(p) for p in prompts]
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_a_transfer_of_another_prefix_is_not_taken(model, engines):
    """A consumer request whose prompt differs from the producer's within the sent blocks
    (as a LoRA adapter of the same name but other weights, or another cache_salt, would make
    its blocks differ) takes no transfer: it would otherwise cache the producer's KV as its
    own. It computes its prompt, as the producer computes it alone."""
    _, prompts, _ = model
    producer, consumer = engines
    other = [4 if prompts[3][0] == 3 else 3, *prompts[3][1:]]
    expected = _run(producer, "alone", other, GREEDY, None).outputs[0].token_ids
    address = consumer.engine.runner.connector.address
    prefill = _run(producer, "p0", prompts[3], PREFILL,
                   {"transfer_id": "t0", "consumer_address": address})
    with stepping(producer):
        decode = _run(consumer, "c0", other, GREEDY, prefill.kv_transfer_params)
    assert decode.outputs[0].token_ids == expected
    assert decode.num_cached_tokens == 0
    assert consumer.get_metrics().get("kvtier:p2p_connector_blocks_loaded", 0.0) == 0
    # The consumer took the transfer and dropped it: the producer's blocks are freed well
    # before its send_timeout_s (5 s).
    start = time.monotonic()
    _drain(producer)
    assert time.monotonic() - start < 4.5
    # A producer that hashes blocks another way is not checked (nothing to compare with).
    params = {**prefill.kv_transfer_params,
              "block_hash": "xxhash:" + prefill.kv_transfer_params["block_hash"].split(":")[1]}
    from kvtier.connector.p2p.metadata import LoadParams
    scheduler = consumer.engine.scheduler.connector
    assert scheduler._same_prefix(Request("x", other, block_hasher=make_block_hasher(
        BLOCK_SIZE)), LoadParams.parse(params))


def test_lost_transfer_is_recomputed_and_frees_the_producer(model, engines):
    _, prompts, expected = model
    producer, consumer = engines
    # The consumer expects a transfer nobody sends: its load fails at kv_load_timeout_s and
    # the prompt is computed locally.
    decode = _run(consumer, "c0", prompts[0], GREEDY, {"transfer_id": "never", "num_tokens": 16})
    assert decode.outputs[0].token_ids == expected[0]
    assert decode.num_cached_tokens == 0
    assert _metric_reaches(consumer, "kvtier:p2p_connector_load_errors", 4)
    # The producer sends to a consumer that never asks: its blocks are freed at send_timeout_s.
    _run(producer, "p0", prompts[0], PREFILL,
         {"transfer_id": "unwanted", "consumer_address": consumer.engine.runner.connector.address})
    # Held while the send is pending: freeing them would let another request overwrite the KV
    # the transport may still be reading.
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() < 63
    start = time.monotonic()
    _drain(producer)
    assert 4.0 < time.monotonic() - start < 8.0  # send_timeout_s is 5
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    assert producer.get_metrics()["kvtier:p2p_connector_send_errors"] == 1


def test_an_idle_consumer_waits_for_its_load_rather_than_a_fixed_sleep(model, engines):
    _, prompts, expected = model
    producer, consumer = engines
    address = consumer.engine.runner.connector.address
    prefill = _run(producer, "p0", prompts[0], PREFILL,
                   {"transfer_id": "t0", "consumer_address": address})
    consumer.engine.add_request("c0", prompts[0], GREEDY,
                                kv_transfer_params=prefill.kv_transfer_params)
    consumer.engine.step()  # posts the loads; nothing to compute yet
    # The producer's serving loop: it connects and sends the request's layers.
    push = threading.Timer(0.3, _drain, [producer])
    start = time.monotonic()
    push.start()
    consumer.engine.runner.connector.wait_for_transfers(timeout_s=10.0)
    elapsed = time.monotonic() - start
    push.join()
    assert 0.3 <= elapsed < 2.0  # woken by the first layer that landed, not by the timeout
    finished = []
    for _ in range(10_000):
        finished += [o for o in consumer.engine.step() if o.finished]
        if finished:
            break
    assert [o.outputs[0].token_ids for o in finished] == [expected[0]]
    assert finished[0].num_cached_tokens == loaded_tokens(prompts[0])
    _drain(producer)


def test_kv_transfer_params_and_options_are_checked():
    from kvtier.connector.p2p.metadata import LoadParams, P2PConnectorOptions, SendParams

    assert SendParams.parse(None) is None and LoadParams.parse({"other": 1}) is None
    assert LoadParams.parse({"transfer_id": "t", "num_tokens": 8}) == LoadParams("t", 8)
    assert LoadParams.parse({"transfer_id": "t", "num_tokens": 8, "block_hash": "ab"}) == \
        LoadParams("t", 8, "ab")
    with pytest.raises(ValueError, match="block_hash must be a hex string"):
        LoadParams.parse({"transfer_id": "t", "num_tokens": 8, "block_hash": 5})
    with pytest.raises(ValueError, match="num_tokens"):
        LoadParams.parse({"transfer_id": "t", "num_tokens": "8"})
    with pytest.raises(ValueError, match="consumer_address"):
        SendParams.parse({"transfer_id": "t", "consumer_address": 5})
    with pytest.raises(ValueError, match="port"):
        P2PConnectorOptions(port=70000)
    with pytest.raises(ValueError, match="send_timeout_s"):
        P2PConnectorOptions(send_timeout_s=0)
    with pytest.raises(ValueError, match="unclaimed_offer_timeout_s"):
        P2PConnectorOptions(unclaimed_offer_timeout_s=-1)
    with pytest.raises(ValueError, match="transport must be one of"):
        P2PConnectorOptions(transport="nixl")
    with pytest.raises(ValueError, match='push must be "layer" or "request"'):
        P2PConnectorOptions(push="block")


def test_aborted_prefill_sends_nothing(model, engines):
    _, prompts, _ = model
    producer, consumer = engines
    producer.engine.add_request("p0", prompts[0], PREFILL, kv_transfer_params={
        "transfer_id": "t0", "consumer_address": consumer.engine.runner.connector.address})
    producer.engine.abort_request(["p0"])  # before any of its KV was computed
    _drain(producer)
    metrics = producer.get_metrics()
    assert metrics["kvtier:p2p_connector_requests_sent"] == 0
    assert metrics["kvtier:p2p_connector_send_errors"] == 0
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63


@pytest.mark.skipif("mooncake" in UNAVAILABLE, reason=UNAVAILABLE.get("mooncake", ""))
def test_decode_over_the_mooncake_transport_matches_hf(model):
    model_dir, prompts, expected = model
    producer, consumer = (
        LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_device_blocks=64,
            kv_transfer_config={"kv_connector": "P2PConnector", "kv_role": role,
                                "kv_connector_extra_config": {"transport": "mooncake"}})
        for role in ("kv_producer", "kv_consumer"))
    try:
        _, decodes = hand_over(producer, consumer, prompts)
        assert [d.outputs[0].token_ids for d in decodes] == expected
        assert [d.num_cached_tokens for d in decodes] == [loaded_tokens(p) for p in prompts]
        _drain(producer)
        assert producer.get_metrics()["kvtier:p2p_connector_requests_sent"] == len(prompts)
        assert consumer.get_metrics()["kvtier:p2p_connector_blocks_loaded"] == 13
    finally:
        for llm in (producer, consumer):
            llm.engine.shutdown()


@pytest.fixture
def layer_engines(model):
    """A producer that pushes layer by layer and computes a prompt 8 tokens per step."""
    with engine_pair(model[0], push="layer", max_num_batched_tokens=8) as pair:
        yield pair


def test_layer_push_over_chunked_prefill_matches_hf(model, layer_engines):
    _, prompts, expected = model
    producer, consumer = layer_engines
    prefills, decodes = hand_over(producer, consumer, prompts)
    assert [p.kv_transfer_params["num_tokens"] for p in prefills] == \
        [len(prompt) // BLOCK_SIZE * BLOCK_SIZE for prompt in prompts]
    assert [d.outputs[0].token_ids for d in decodes] == expected
    assert [d.num_cached_tokens for d in decodes] == [loaded_tokens(p) for p in prompts]
    assert consumer.get_metrics()["kvtier:p2p_connector_blocks_loaded"] == 13
    start = time.monotonic()
    _drain(producer)
    assert time.monotonic() - start < 4.5  # every send ended, well before send_timeout_s
    assert producer.get_metrics()["kvtier:p2p_connector_requests_sent"] == len(prompts)
    assert producer.engine.runner.connector.num_open_transfers == 0
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    _drain(consumer)


def test_layer_push_ending_before_its_request_frees_the_blocks(model, layer_engines):
    _, prompts, expected = model
    producer, consumer = layer_engines
    params = {"transfer_id": "t0", "consumer_address": consumer.engine.runner.connector.address}
    # Connected beforehand, as a producer that served this consumer before: each layer goes
    # out in the step that computes it.
    producer.engine.runner.connector._connections.get(params["consumer_address"]).result(5)
    producer.engine.add_request("p0", prompts[0], GREEDY, kv_transfer_params=params)
    for _ in range(10):  # until the prompt is computed and its layers are sent
        producer.engine.step()
        if producer.engine.scheduler.requests["p0"].num_output_tokens:
            break
    assert producer.engine.runner.connector.num_open_transfers == 1
    # The producer goes on decoding while the consumer takes the transfer.
    decode = _run(consumer, "c0", prompts[0], GREEDY,
                  {"transfer_id": "t0", "num_tokens": len(prompts[0]) // BLOCK_SIZE * BLOCK_SIZE})
    assert decode.outputs[0].token_ids == expected[0]
    assert decode.num_cached_tokens == 16
    connector = producer.engine.runner.connector
    num_layers = len(connector.kv_caches)
    deadline = time.monotonic() + 10.0
    while connector.transport.stats()["sent"] < num_layers and time.monotonic() < deadline:
        time.sleep(0.01)  # the transport's thread takes the consumer's done messages
    producer.engine.step()  # a decode step of p0, which collects the ended sends
    assert producer.engine.runner.connector.num_open_transfers == 0
    assert producer.engine.scheduler.requests["p0"].num_output_tokens < MAX_TOKENS
    start = time.monotonic()
    _drain(producer)
    # The sends ended while p0 was still decoding; its blocks are freed once it finished, not
    # at send_timeout_s and not never.
    assert time.monotonic() - start < 4.5
    assert producer.get_metrics()["kvtier:p2p_connector_requests_sent"] == 1
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    _drain(consumer)


def test_layer_push_with_a_failed_layer_is_recomputed(model, layer_engines):
    _, prompts, expected = model
    producer, consumer = layer_engines
    connector = producer.engine.runner.connector
    send = connector.transport.send

    def send_all_but_layer_1(peer, transfer_id, regions, timeout_s):
        if transfer_id.endswith("/1"):
            raise TransportError("injected: layer 1 cannot be sent")
        send(peer, transfer_id, regions, timeout_s)

    connector.transport.send = send_all_but_layer_1
    address = consumer.engine.runner.connector.address
    prefill = _run(producer, "p0", prompts[0], PREFILL,
                   {"transfer_id": "t0", "consumer_address": address})
    # Layer 0 arrives, layer 1 never does: the load fails at kv_load_timeout_s (2 s) and the
    # consumer computes the prompt itself.
    decode = _run(consumer, "c0", prompts[0], GREEDY, prefill.kv_transfer_params)
    assert decode.outputs[0].token_ids == expected[0]
    assert decode.num_cached_tokens == 0
    assert _metric_reaches(consumer, "kvtier:p2p_connector_load_errors", 4)
    assert consumer.engine.runner.connector.num_open_transfers == 0
    # A push nobody asks for ends at send_timeout_s (5 s) and lets go of its host copy.
    _run(producer, "p1", prompts[1], PREFILL, {"transfer_id": "unwanted",
                                               "consumer_address": address})
    start = time.monotonic()
    _drain(producer)
    assert 4.0 < time.monotonic() - start < 8.0
    assert connector.num_open_transfers == 0
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    assert producer.get_metrics()["kvtier:p2p_connector_send_errors"] == 2
    assert producer.get_metrics()["kvtier:p2p_connector_requests_sent"] == 0
    _drain(consumer)


def test_layer_push_of_an_aborted_or_short_prefill_sends_nothing(model, layer_engines):
    _, prompts, _ = model
    producer, consumer = layer_engines
    producer.engine.add_request("p0", prompts[3], PREFILL, kv_transfer_params={
        "transfer_id": "t0", "consumer_address": consumer.engine.runner.connector.address})
    producer.engine.step()  # the first 8 of its 23 tokens: two blocks copied, nothing sent
    assert producer.engine.runner.connector.num_open_transfers == 1
    producer.engine.abort_request(["p0"])
    producer.engine.step()
    assert producer.engine.runner.connector.num_open_transfers == 0
    # A prompt shorter than one block has nothing to push.
    short = _run(producer, "p1", prompts[0][:3], PREFILL, {
        "transfer_id": "t1", "consumer_address": consumer.engine.runner.connector.address})
    assert short.kv_transfer_params == {"transfer_id": "t1", "num_tokens": 0}
    metrics = producer.get_metrics()
    assert metrics["kvtier:p2p_connector_requests_sent"] == 0
    assert metrics["kvtier:p2p_connector_send_errors"] == 0
    _drain(producer)
    assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_layer_major_payload_layout_and_round_trip():
    from kvtier.connector.p2p.layout import (
        LayerMajorPayload,
        layer_transfer_id,
        split_layer_transfer_id,
    )

    torch.manual_seed(0)
    # (2, num_blocks, block_size, kv_heads, head_dim); layers may differ in shape.
    source = {"l0": torch.randn(2, 8, 4, 2, 3), "l1": torch.randn(2, 8, 4, 1, 5)}
    payload = LayerMajorPayload(source, num_blocks=3)
    payload.copy_out(0, 0, source["l0"], [6])
    payload.copy_out(0, 1, source["l0"], [5, 2])
    payload.copy_out(1, 0, source["l1"], [6, 5, 2])
    regions = [payload.region("b", i) for i in range(2)]
    # 2 x 4 x 2 x 3 and 2 x 4 x 1 x 5 fp32 values a block.
    assert [(r.offset, r.length) for r in regions] == [(0, 3 * 192), (3 * 192, 3 * 160)]
    for region, cache in zip(regions, source.values()):
        # Each layer's region is its blocks one after the other, K then V within a block.
        area = payload.buffer[region.offset:region.offset + region.length].view(torch.float32)
        assert torch.equal(area, torch.cat([cache[:, b].reshape(-1) for b in (6, 5, 2)]))
    target = {name: torch.zeros_like(cache) for name, cache in source.items()}
    for i, name in enumerate(target):
        payload.copy_in(i, 1, target[name], [0, 7])
        assert torch.equal(target[name][:, [0, 7]], source[name][:, [5, 2]])
        assert not target[name][:, 1:7].any()
    assert split_layer_transfer_id(layer_transfer_id("a/b", 12)) == ("a/b", 12)
