"""The simulation's clock: each step costs what it computes and the context it attends to."""

import pytest

from kvtier.entrypoints.bench.trace import ScaledRequest
from kvtier.offload.config import OffloadConfig, parse_kv_offload
from kvtier.planner.blocks import BlockKeys
from kvtier.planner.cost_model import CostModel, prefill_pairs
from kvtier.planner.model_kv import model_kv
from kvtier.planner.plan import plan_requests, request_row
from kvtier.planner.simulator import SchedulerLimits, SimRequest, Simulation

from ..tiny_models import make_hf_model

BASE, PER_TOKEN, PER_SEQ, PER_PAIR, PER_CONTEXT = 0.01, 1e-3, 2e-3, 1e-5, 1e-4


def test_chunked_prefill_after_a_prefix_hit_pays_for_its_context(tmp_path):
    make_hf_model("llama", tmp_path)
    model = model_kv(str(tmp_path), 4, "float32")
    cost = CostModel(BASE, PER_TOKEN, PER_SEQ, prefill_s_per_pair=PER_PAIR,
                     decode_s_per_context_token=PER_CONTEXT)
    # 8 tokens per hash id; the second prompt extends the first, long after it finished.
    scaled = [ScaledRequest(0, 0.0, (0, 1, 2), 24, 2), ScaledRequest(1, 100.0, (0, 1, 2, 3), 32, 3)]
    first, second = plan_requests(scaled, BlockKeys(8, 4))
    simulation = Simulation(model, 64 * model.bytes_per_block, None, cost,
                            SchedulerLimits(max_num_batched_tokens=16))
    simulation.run([first, second])

    def step(tokens=0, pairs=0, seqs=0, context=0):
        return BASE + PER_TOKEN * tokens + PER_PAIR * pairs + PER_SEQ * seqs + PER_CONTEXT * context

    # 24 tokens in chunks of 16 and 8; the second chunk attends to the first.
    ttft = step(16, prefill_pairs(16, 0)) + step(8, prefill_pairs(8, 16))
    assert first.first_token_s == pytest.approx(ttft)
    assert first.finished_s == pytest.approx(ttft + step(seqs=1, context=24 + 1))
    # The second hits the first's 24 tokens on the device and computes 8 after them.
    assert second.hit_tokens == [24]
    ttft = step(8, prefill_pairs(8, 24))
    assert second.first_token_s - 100.0 == pytest.approx(ttft)
    decodes = step(seqs=1, context=32 + 1) + step(seqs=1, context=32 + 2)
    assert second.finished_s - 100.0 == pytest.approx(ttft + decodes)


def _simulation(directory, cost: CostModel, limits: SchedulerLimits) -> Simulation:
    make_hf_model("llama", directory)
    model = model_kv(str(directory), 4, "float32")
    return Simulation(model, 256 * model.bytes_per_block, None, cost, limits)


def test_a_step_of_n_decodes_costs_what_the_model_says(tmp_path):
    cost = CostModel(BASE, PER_TOKEN, PER_SEQ, prefill_s_per_pair=PER_PAIR,
                     decode_s_per_context_token=PER_CONTEXT)
    # Four 8-token prompts (distinct blocks) at once: one step prefills all four, then every
    # step decodes the four together.
    scaled = [ScaledRequest(i, 0.0, (2 * i, 2 * i + 1), 8, 3) for i in range(4)]
    requests = plan_requests(scaled, BlockKeys(4, 4))
    _simulation(tmp_path, cost, SchedulerLimits(max_num_batched_tokens=64)).run(requests)
    prefill = cost.step_s(32, 0, 4 * prefill_pairs(8, 0))
    # Each decode attends to its prompt and the tokens it generated, itself included.
    decodes = cost.step_s(0, 4, 0, 4 * (8 + 1)) + cost.step_s(0, 4, 0, 4 * (8 + 2))
    assert decodes == pytest.approx(2 * BASE + 8 * PER_SEQ + 76 * PER_CONTEXT)
    for request in requests:
        assert request.first_token_s == pytest.approx(prefill)
        assert request.finished_s == pytest.approx(prefill + decodes)


def test_arrivals_faster_than_the_steps_queue(tmp_path):
    cost = CostModel(BASE, PER_TOKEN, PER_SEQ, prefill_s_per_pair=PER_PAIR)
    # One 16-token prompt per step (the whole budget), one output token: each request is one
    # step of `service` seconds, and they arrive every `gap` < service seconds.
    service = cost.step_s(16, 0, prefill_pairs(16, 0))
    gap = service / 2
    scaled = [ScaledRequest(i, i * gap, (4 * i, 4 * i + 1), 16, 1) for i in range(6)]
    requests = plan_requests(scaled, BlockKeys(8, 4))
    simulation = _simulation(tmp_path, cost, SchedulerLimits(max_num_batched_tokens=16))
    simulation.run(requests)
    rows = [request_row(r, simulation.level_names) for r in requests]
    for k, row in enumerate(rows):
        # Request k starts when the k before it are done: it waits k * (service - gap).
        assert row["admitted_s"] == pytest.approx(k * service)
        assert row["ttft_s"] == pytest.approx((k + 1) * service - k * gap)
        assert row["hit_tokens"] == {"device": 0}
    # Spread out wider than a step, nobody waits.
    spread = [ScaledRequest(i, i * 2 * service, (4 * i, 4 * i + 1), 16, 1) for i in range(6)]
    requests = plan_requests(spread, BlockKeys(8, 4))
    _simulation(tmp_path / "spread", cost, SchedulerLimits(max_num_batched_tokens=16)).run(
        requests)
    assert [r.first_token_s - r.arrival_s for r in requests] == pytest.approx([service] * 6)


def test_stores_and_serving_cost_what_the_model_says(tmp_path):
    make_hf_model("llama", tmp_path)
    model = model_kv(str(tmp_path), 4, "float32")
    offload = OffloadConfig.from_extra_config(parse_kv_offload("host=1MiB,disk=unused:4MiB"))
    # One 16-token prompt (4 blocks of 4, one chunk each), three output tokens, alone.
    scaled = [ScaledRequest(0, 0.0, (0, 1), 16, 3)]

    def run(cost: CostModel) -> SimRequest:
        (request,) = plan_requests(scaled, BlockKeys(8, 4))
        Simulation(model, 64 * model.bytes_per_block, offload, cost,
                   SchedulerLimits(max_num_batched_tokens=64)).run([request])
        return request

    plain = run(CostModel(BASE, PER_TOKEN, PER_SEQ, {"host": 1e-9, "disk": 1e-9}))
    host_store, disk_store, per_step, per_token = 2e-7, 5e-7, 0.03, 0.007
    served = run(CostModel(BASE, PER_TOKEN, PER_SEQ, {"host": 1e-9, "disk": 1e-9},
                           store_s_per_byte={"host": host_store, "disk": disk_store},
                           server_s_per_step=per_step, server_s_per_token=per_token))
    # The prefill step streams the first token and stores its 4 chunks to host memory and on
    # to the disk (write-through), beside the next step: the first decode waits for them.
    # Each decode step streams one token.
    stores = 4 * model.bytes_per_block * (host_store + disk_store)
    assert served.first_token_s - plain.first_token_s == pytest.approx(per_step + per_token)
    assert served.finished_s - plain.finished_s == pytest.approx(
        stores + 3 * (per_step + per_token))
    # Idle time absorbs stores: a one-token request, then a second one (other blocks) that
    # arrives when half of the first one's stores are done, and pays the other half.
    cost = CostModel(BASE, PER_TOKEN, PER_SEQ, {"host": 1e-9, "disk": 1e-9},
                     store_s_per_byte={"host": host_store, "disk": disk_store})
    prefill = cost.step_s(16, 0)
    first, second = plan_requests([ScaledRequest(0, 0.0, (0, 1), 16, 1),
                                   ScaledRequest(1, prefill + stores / 2, (2, 3), 16, 1)],
                                  BlockKeys(8, 4))
    Simulation(model, 64 * model.bytes_per_block, offload, cost,
               SchedulerLimits(max_num_batched_tokens=64)).run([first, second])
    assert first.first_token_s == pytest.approx(prefill)
    assert second.first_token_s - second.arrival_s == pytest.approx(prefill + stores / 2)
