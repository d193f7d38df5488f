"""Shared pieces of the P2PConnector tests: engines of a role on a tiny model, and prompts
handed from a producer to a consumer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier import LLM, SamplingParams

BLOCK_SIZE = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def p2p_llm(model_dir: str, role: str, push: str = "request", max_num_batched_tokens: int = 2048,
            device: str | None = None, kv_cache_dtype: str = "auto", **fields) -> LLM:
    """An fp32 engine of 64 blocks with the P2PConnector in `role`; `fields`: more of its
    kv_transfer_config."""
    extra = {"send_timeout_s": 5.0, "push": push} if role == "kv_producer" else {}
    return LLM(model_dir, dtype="float32", device=device, block_size=BLOCK_SIZE,
               num_device_blocks=64, max_num_batched_tokens=max_num_batched_tokens,
               kv_cache_dtype=kv_cache_dtype,
               kv_transfer_config={"kv_connector": "P2PConnector", "kv_role": role,
                                   "kv_connector_extra_config": extra, **fields})


@contextmanager
def engine_pair(model_dir: str, device: str | None = None, consumer_kv_cache_dtype: str = "auto",
                **producer_options) -> Iterator[tuple[LLM, LLM]]:
    """(producer, consumer), shut down on exit; the consumer gives up a load after 2 s."""
    producer = p2p_llm(model_dir, "kv_producer", device=device, **producer_options)
    consumer = p2p_llm(model_dir, "kv_consumer", device=device, kv_load_timeout_s=2.0,
                       kv_cache_dtype=consumer_kv_cache_dtype)
    try:
        yield producer, consumer
    finally:
        for llm in (producer, consumer):
            llm.engine.shutdown()


def run_request(llm: LLM, request_id: str, prompt, params, kv_transfer_params):
    """Add a request and step `llm` until it finishes; its final output."""
    llm.engine.add_request(request_id, prompt, params, kv_transfer_params=kv_transfer_params)
    for _ in range(10_000):
        for output in llm.engine.step():
            if output.request_id == request_id and output.finished:
                return output
    raise AssertionError(f"{request_id} did not finish")


@contextmanager
def stepping(llm: LLM) -> Iterator[None]:
    """Step `llm` in the background, as its serving loop would, until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            llm.engine.step()
            time.sleep(0.005)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def hand_over(producer: LLM, consumer: LLM,
              prompts: list[list[int]]) -> tuple[list, list]:
    """Each prompt prefilled on `producer` (transfer t<i>), then decoded greedily on `consumer`
    with the returned kv_transfer_params while the producer steps, as its serving loop would
    (it connects to the consumer and sends there); (prefill outputs, decode outputs)."""
    address = consumer.engine.runner.connector.address
    prefills, decodes = [], []
    for i, prompt in enumerate(prompts):
        prefills.append(run_request(producer, f"p{i}", prompt, PREFILL,
                                    {"transfer_id": f"t{i}", "consumer_address": address}))
        with stepping(producer):
            decodes.append(run_request(consumer, f"c{i}", prompt, GREEDY,
                                       prefills[-1].kv_transfer_params))
    return prefills, decodes


def loaded_tokens(prompt: list[int]) -> int:
    """What a consumer caches of `prompt`: every full block before its last token."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
