"""P2PConnector when a consumer restarts, hangs, refuses or aborts a request, or is handed bad
kv_transfer_params, on a tiny random Llama: the producer's step never waits for a consumer, a
restarted consumer is connected again, a transfer no consumer request takes frees the
producer's blocks early, and a bad request costs its own transfer and no other request
anything."""

from __future__ import annotations

import socket
import time

import pytest

from kvtier import LLM
from kvtier.engine.errors import EngineQueueFullError
from kvtier.transport import TransportError
from tests.transport.p2p_helpers import (
    BLOCK_SIZE,
    GREEDY,
    PREFILL,
    loaded_tokens,
    p2p_llm,
    run_request,
    stepping,
)


def _drain(llm: LLM) -> dict:
    """Step until no request is left; the final outputs of those that finished meanwhile."""
    finished = {}
    while llm.engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in llm.engine.step() if o.finished}
    llm.engine.check_invariants()
    return finished


def _consumer(model_dir: str, port: int = 0) -> LLM:
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return p2p_llm(model_dir, "kv_consumer", kv_load_timeout_s=5.0,
                           kv_connector_extra_config={"port": port})
        except TransportError:  # the port of the consumer just shut down, not yet free
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_consumer_restarted_at_its_address_gets_its_kv(model):
    model_dir, prompts, expected = model
    producer, consumer = p2p_llm(model_dir, "kv_producer"), _consumer(model_dir)
    try:
        address = consumer.engine.runner.connector.address
        for i, prompt in enumerate(prompts[:2]):
            if i == 1:  # the producer's connection outlives the consumer process it reached
                consumer.engine.shutdown()
                consumer = _consumer(model_dir, int(address.rsplit(":", 1)[1]))
            prefill = run_request(producer, f"p{i}", prompt, PREFILL,
                                  {"transfer_id": f"t{i}", "consumer_address": address})
            with stepping(producer):
                decode = run_request(consumer, f"c{i}", prompt, GREEDY,
                                     prefill.kv_transfer_params)
            assert decode.outputs[0].token_ids == expected[i]
            assert decode.num_cached_tokens == loaded_tokens(prompt)
            _drain(producer)
        metrics = producer.get_metrics()
        assert metrics["kvtier:p2p_connector_requests_sent"] == 2
        assert metrics["kvtier:p2p_connector_send_errors"] == 0
    finally:
        for llm in (producer, consumer):
            llm.engine.shutdown()


@pytest.mark.parametrize("push", ["request", "layer"])
def test_a_consumer_that_never_answers_never_holds_up_the_producers_step(model, push):
    model_dir, prompts, expected = model
    producer = p2p_llm(model_dir, "kv_producer", kv_connector_extra_config={
        "send_timeout_s": 5.0, "connect_timeout_s": 2.0, "push": push})
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never speaks
    address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    try:
        producer.engine.add_request("other", prompts[1], GREEDY, kv_transfer_params=None)
        producer.engine.add_request("p0", prompts[0], PREFILL, kv_transfer_params={
            "transfer_id": "t0", "consumer_address": address})
        slowest, finished, start = 0.0, {}, time.monotonic()
        while producer.engine.has_unfinished_requests():
            step_start = time.monotonic()
            finished |= {o.request_id: o for o in producer.engine.step() if o.finished}
            slowest = max(slowest, time.monotonic() - step_start)
        # The connect failed at its 2 s in the background; no step waited for it.
        assert slowest < 1.0 and 1.5 < time.monotonic() - start < 4.5
        assert finished["other"].outputs[0].token_ids == expected[1]
        assert producer.get_metrics()["kvtier:p2p_connector_send_errors"] == 1
        # Within the failure's back-off another send to it fails at once.
        start = time.monotonic()
        run_request(producer, "p1", prompts[3], PREFILL, {
            "transfer_id": "t1", "consumer_address": address})
        _drain(producer)
        assert time.monotonic() - start < 1.0
        assert producer.get_metrics()["kvtier:p2p_connector_send_errors"] == 2
        assert producer.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    finally:
        producer.engine.shutdown()
        silent.close()


def test_num_tokens_beyond_the_prompt_is_refused_and_fails_no_other_request(model):
    model_dir, prompts, expected = model
    consumer = p2p_llm(model_dir, "kv_consumer", kv_load_timeout_s=2.0)
    huge = 10 ** 15  # would size a host buffer of petabytes
    try:
        consumer.engine.add_request("other", prompts[1], GREEDY, kv_transfer_params=None)
        consumer.engine.add_request("load", prompts[0], GREEDY, kv_transfer_params={
            "transfer_id": "t0", "num_tokens": huge})
        finished = _drain(consumer)
        assert finished["other"].outputs[0].token_ids == expected[1]
        assert finished["load"].outputs[0].token_ids == expected[0]
        assert finished["load"].num_cached_tokens == 0
        # The prompt is in the local prefix cache now: the transfer would only be drained.
        drain = run_request(consumer, "drain", prompts[0], GREEDY,
                            {"transfer_id": "t1", "num_tokens": huge})
        assert drain.outputs[0].token_ids == expected[0]
        assert drain.num_cached_tokens == loaded_tokens(prompts[0])
        assert consumer.engine.runner.connector.num_open_transfers == 0
    finally:
        consumer.engine.shutdown()


def _free_blocks(llm: LLM) -> int:
    return llm.engine.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_transfer_for_a_request_the_consumer_refused_frees_the_producer_early(model):
    """The consumer's queue is full: it refuses the request (a server answers 503) before its
    connector sees it, and the router sends it elsewhere. Its transport fails the offers
    nobody claimed after unclaimed_offer_timeout_s, well before the producer's 5 s
    send_timeout_s; the request, should it come after all, computes its prompt."""
    model_dir, prompts, expected = model
    producer = p2p_llm(model_dir, "kv_producer")
    consumer = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_device_blocks=64,
                   max_waiting_requests=1, kv_transfer_config={
                       "kv_connector": "P2PConnector", "kv_role": "kv_consumer",
                       "kv_load_timeout_s": 5.0,
                       "kv_connector_extra_config": {"unclaimed_offer_timeout_s": 0.5}})
    try:
        address = consumer.engine.runner.connector.address
        prefill = run_request(producer, "p0", prompts[0], PREFILL,
                              {"transfer_id": "t0", "consumer_address": address})
        consumer.engine.add_request("queued", prompts[1], GREEDY)
        with pytest.raises(EngineQueueFullError):
            consumer.engine.add_request("c0", prompts[0], GREEDY,
                                        kv_transfer_params=prefill.kv_transfer_params)
        start = time.monotonic()
        _drain(producer)
        assert 0.5 <= time.monotonic() - start < 2.5
        assert _free_blocks(producer) == 63
        assert producer.get_metrics()["kvtier:p2p_connector_send_errors"] == 1
        assert _drain(consumer)["queued"].outputs[0].token_ids == expected[1]
        start = time.monotonic()
        late = run_request(consumer, "c0", prompts[0], GREEDY, prefill.kv_transfer_params)
        assert time.monotonic() - start < 2.0  # not kv_load_timeout_s
        assert late.outputs[0].token_ids == expected[0] and late.num_cached_tokens == 0
    finally:
        for llm in (producer, consumer):
            llm.engine.shutdown()


def test_a_request_aborted_before_it_was_scheduled_drops_its_transfer(model):
    model_dir, prompts, _ = model
    producer = p2p_llm(model_dir, "kv_producer")
    consumer = _consumer(model_dir)
    try:
        address = consumer.engine.runner.connector.address
        prefill = run_request(producer, "p0", prompts[0], PREFILL,
                              {"transfer_id": "t0", "consumer_address": address})
        consumer.engine.add_request("c0", prompts[0], GREEDY,
                                    kv_transfer_params=prefill.kv_transfer_params)
        consumer.engine.abort_request("c0")  # e.g. its client went away while it waited
        start = time.monotonic()
        with stepping(consumer):  # its next step takes the transfer and drops it
            _drain(producer)
        assert time.monotonic() - start < 2.0  # not at the producer's 5 s send_timeout_s
        assert _free_blocks(producer) == 63
        metrics = producer.get_metrics()
        assert metrics["kvtier:p2p_connector_requests_sent"] == 1
        assert metrics["kvtier:p2p_connector_send_errors"] == 0
        assert consumer.engine.runner.connector.num_open_transfers == 0
        assert _free_blocks(consumer) == 63
    finally:
        for llm in (producer, consumer):
            llm.engine.shutdown()
