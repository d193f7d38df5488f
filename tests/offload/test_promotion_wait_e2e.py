"""An engine whose only live request waits on promotions sleeps until they end, and a request
arriving meanwhile is taken at once: AsyncLLM's command ends the idle wait (tiny random Llama,
output checked against HF transformers, fp32 greedy)."""

import asyncio

import pytest

from kvtier import LLM, SamplingParams
from kvtier.engine import engine as engine_module
from kvtier.engine.async_llm import AsyncLLM

from ..tiny_models import hf_greedy, make_hf_model, random_prompts
from . import faulty_tiers
from .offload_helpers import FAULTY_TIERS

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
# Far longer than the test may take: an idle wait only ends early when woken.
IDLE_WAIT_S = 120.0
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", directory, max_position_embeddings=256)
    # A 30-token prompt has 7 chunks to look up; a 4-token one none (its last token is
    # always computed), so it never waits on the tier.
    prompts = random_prompts(1, 30) + random_prompts(1, 4)
    return str(directory), prompts, hf_greedy(hf, prompts, PARAMS.max_tokens)


async def _tokens(async_llm: AsyncLLM, prompt, request_id):
    last = None
    async for output in async_llm.generate(prompt, PARAMS, request_id):
        last = output
    return last.outputs[0].token_ids


def test_a_request_arriving_during_a_wait_on_promotions_is_served_at_once(model, monkeypatch):
    model_dir, (waits, arrives), expected = model
    monkeypatch.setattr(engine_module, "IDLE_STEP_WAIT_S", IDLE_WAIT_S)
    faulty_tiers.RELEASE_SLOW_LOADS.clear()
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [{"type": "SlowLoadTier", "module_path": FAULTY_TIERS}]}}
    async_llm = AsyncLLM(lambda: LLM(model_dir, dtype="float32", block_size=4,
                                     num_device_blocks=64, kv_transfer_config=config).engine)

    async def scenario():
        waiting = asyncio.create_task(_tokens(async_llm, waits, "waits"))
        connector = async_llm.engine.scheduler.connector
        for _ in range(int(DEADLINE_S / 0.01)):
            if connector.manager.watch._in_flight or waiting.done():
                break  # its promotions are under way (or it failed: awaited below)
            await asyncio.sleep(0.01)
        assert not waiting.done(), await waiting
        await asyncio.sleep(0.2)  # the engine thread is asleep in its idle wait by now
        served = await asyncio.wait_for(_tokens(async_llm, arrives, "arrives"), DEADLINE_S)
        assert not waiting.done()  # still waiting for its promotions
        faulty_tiers.RELEASE_SLOW_LOADS.set()  # they fail: the request recomputes
        return served, await asyncio.wait_for(waiting, DEADLINE_S)

    try:
        served, recomputed = asyncio.run(scenario())
        assert [recomputed, served] == expected
    finally:
        faulty_tiers.RELEASE_SLOW_LOADS.set()
        async_llm.shutdown(drain_timeout_s=5)
