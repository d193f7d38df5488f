"""The cost model: its JSON form, its sums, and the calibration fit."""

import json

import pytest
import torch

from kvtier.entrypoints import cli
from kvtier.offload.config import OffloadConfig, parse_kv_offload
from kvtier.planner.calibrate import BatchRuns, Measurement, _fit, store_costs, stored_bytes
from kvtier.planner.calibrate_served import ServedBatch, fit_served
from kvtier.planner.cost_model import (
    CostModel,
    default_cost_model_path,
    load_cost_model,
    prefill_pairs,
    write_cost_model,
)

from ..entrypoints.server_process import ServerProcess
from ..tiny_models import make_hf_model

torch.set_num_threads(1)


def test_step_and_load_costs_add_up():
    cost = CostModel(0.01, 1e-4, 2e-3, {"host": 1e-9, "disk": 4e-9})
    assert cost.step_s(1000, 10) == pytest.approx(0.01 + 0.1 + 0.02)
    assert cost.load_s("disk", 10**6) == pytest.approx(4e-3)
    with pytest.raises(ValueError, match="no load cost for the 'fs' tier"):
        cost.load_s("fs", 1)


def test_json_round_trip_and_bad_files(tmp_path):
    cost = CostModel(0.01, 1e-4, 2e-3, {"host": 1e-9}, model="m", machine="here",
                     prefill_s_per_pair=1e-8)
    path = tmp_path / "cost.json"
    write_cost_model(cost, path, measurements=[{"prefill_tokens": 1}])
    assert load_cost_model(path) == cost
    raw = json.loads(path.read_text())
    for broken, message in (({**raw, "speed": 1}, "unknown keys"),
                            ({k: v for k, v in raw.items() if k != "decode_s_per_seq"},
                             "missing"),
                            ({**raw, "step_s_base": -1}, "must be a finite number >= 0"),
                            ({**raw, "step_s_base": float("nan")}, "finite number"),
                            ({**raw, "step_s_base": True}, "finite number")):
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            load_cost_model(path)
    with pytest.raises(ValueError, match="cannot read the cost model"):
        load_cost_model(tmp_path / "missing.json")


def test_shipped_cost_model_loads_and_is_the_fit_of_its_measurements():
    cost = load_cost_model(default_cost_model_path())
    assert cost.prefill_s_per_token > 0 and {"host", "disk"} <= set(cost.load_s_per_byte)
    raw = json.loads(default_cost_model_path().read_text())
    fitted = _fit([Measurement(**m) for m in raw["measurements"]])
    assert fitted == pytest.approx((cost.step_s_base, cost.prefill_s_per_token,
                                    cost.decode_s_per_seq, cost.prefill_s_per_pair,
                                    cost.decode_s_per_context_token))


def test_step_cost_grows_with_the_context_attended_to():
    cost = CostModel(0.01, 1e-4, 2e-3, prefill_s_per_pair=1e-7, decode_s_per_context_token=1e-6)
    # 100 tokens after 50 computed: 100 * 50 + 100 * 101 / 2 pairs.
    assert prefill_pairs(100, 50) == 10050
    assert cost.step_s(100, 2, prefill_pairs(100, 50), 300) == pytest.approx(
        0.01 + 1e-2 + 4e-3 + 10050e-7 + 300e-6)


def _measured(truth: CostModel, tokens: int, seqs: int, context: int) -> Measurement:
    """A step of one prefill chunk from an empty context and `seqs` decodes, timed by `truth`."""
    pairs = prefill_pairs(tokens, 0)
    return Measurement(tokens, seqs, truth.step_s(tokens, seqs, pairs, context), pairs, context)


def test_fit_recovers_every_cost():
    truth = CostModel(0.005, 2e-4, 3e-3, prefill_s_per_pair=4e-7, decode_s_per_context_token=2e-6)
    rows = [(128, 0, 0), (512, 0, 0), (1024, 0, 0), (2048, 0, 0), (0, 1, 24), (0, 4, 24),
            (0, 16, 24), (0, 4, 1032)]
    measurements = [_measured(truth, p, d, d * c) for p, d, c in rows]
    assert _fit(measurements) == pytest.approx((0.005, 2e-4, 3e-3, 4e-7, 2e-6))


def test_fit_holds_a_cost_it_cannot_tell_apart_at_zero():
    # Every decode at one context length: its context cost is the per-sequence cost's multiple.
    truth = CostModel(0.005, 2e-4, 3e-3, prefill_s_per_pair=4e-7)
    rows = [(128, 0, 0), (512, 0, 0), (1024, 0, 0), (0, 1, 24), (0, 4, 24), (0, 16, 24)]
    measurements = [_measured(truth, p, d, d * c) for p, d, c in rows]
    assert _fit(measurements) == pytest.approx((0.005, 2e-4, 3e-3, 4e-7, 0.0))


def test_calibrate_measures_a_real_model(tmp_path, capsys):
    directory = tmp_path / "model"
    make_hf_model("llama", directory)
    out = tmp_path / "cost.json"
    # As served with a host tier (every chunk computed is stored to it), and through a server.
    server = ServerProcess(str(directory), "--dtype", "float32", "--kv-offload", "host=16MiB")
    try:
        code = cli.main(["plan", "calibrate", "--model", str(directory), "--dtype", "float32",
                         "--disk-dir", str(tmp_path), "--kv-offload", "host=16MiB",
                         "--served-url", server.url, "--output", str(out)])
    finally:
        server.stop()
    assert code == 0, capsys.readouterr().err
    cost = load_cost_model(out)
    steps = {(m["prefill_tokens"], m["decode_seqs"], m["prefill_pairs"], m["decode_context"])
             for m in json.loads(out.read_text())["measurements"]}
    # The tiny model's context (256) cuts every prompt to 128 tokens or less. A prompt alone:
    assert (127, 0, prefill_pairs(127, 0), 0) in steps
    # 128 prompts of 32 tokens: 64 fill the 2048-token budget; next step those 64 decode (each
    # attending to 33 tokens) beside 62 more prompts; then 126 decode beside the last 2
    # prompts, and all 128 decode together.
    assert (2048, 0, 64 * prefill_pairs(32, 0), 0) in steps
    assert (62 * 32, 64, 62 * prefill_pairs(32, 0), 64 * 33) in steps
    assert (2 * 32, 126, 2 * prefill_pairs(32, 0), 64 * 34 + 62 * 33) in steps
    assert (0, 128, 0, 64 * 35 + 62 * 34 + 2 * 33) in steps
    # Four 120-token prompts, then four decodes over 121 tokens each.
    assert (0, 4, 0, 4 * 121) in steps
    assert all(m["step_s"] > 0 for m in json.loads(out.read_text())["measurements"])
    assert cost.step_s(128, 0) > 0 and cost.load_s("host", 10**6) > 0
    assert "kv_offload host=16MiB" in cost.machine and set(cost.store_s_per_byte) == {"host"}
    # Every batch was served too, once a repeat: its mean time there and in the engine.
    served = json.loads(out.read_text())["served_measurements"]
    assert {(b["num_seqs"], b["prompt_tokens"], b["output_tokens"]) for b in served} == {
        (1, 127, 1), (128, 32, 8), (16, 120, 8), (4, 120, 8)}
    assert all(b["served_s"] > 0 and b["engine_s"] > 0 for b in served)
    assert {b["num_tokens"] for b in served} == {1, 1024, 128, 32}
    assert cost.server_s_per_step >= 0 and cost.server_s_per_token >= 0
    assert cost.load_s("disk", 10**6) > 0 and cost.model == str(directory)


def test_store_and_server_terms_round_trip_and_default_to_zero(tmp_path):
    cost = CostModel(0.01, 1e-4, 2e-3, {"host": 1e-9}, store_s_per_byte={"disk": 3e-9},
                     server_s_per_step=0.004, server_s_per_token=5e-4)
    assert cost.store_s("disk", 10**6) == pytest.approx(3e-3)
    assert cost.store_s("host", 10**6) == 0.0  # a kind it leaves out stores for free
    assert cost.served_s(10) == pytest.approx(0.004 + 10 * 5e-4)
    path = tmp_path / "cost.json"
    write_cost_model(cost, path, [{"prefill_tokens": 1}], served_measurements=[{"num_steps": 1}])
    assert load_cost_model(path) == cost
    # A file from before these terms loads with them at 0.
    raw = json.loads(path.read_text())
    for key in ("store_s_per_byte", "server_s_per_step", "server_s_per_token",
                "served_measurements"):
        del raw[key]
    path.write_text(json.dumps(raw))
    old = load_cost_model(path)
    assert (old.store_s_per_byte, old.server_s_per_step, old.server_s_per_token) == ({}, 0, 0)
    path.write_text(json.dumps({**raw, "store_s_per_byte": {"disk": -1}}))
    with pytest.raises(ValueError, match=r"store_s_per_byte\['disk'\] must be a finite number"):
        load_cost_model(path)


def test_fit_served_recovers_what_serving_adds():
    per_step, per_token = 0.006, 4e-4
    batches = [ServedBatch(n, 32, out, steps, n * out, engine_s,
                           engine_s + per_step * steps + per_token * n * out)
               for n, out, steps, engine_s in ((1, 1, 1, 0.2), (1, 1, 1, 0.9), (128, 8, 10, 3.0),
                                               (16, 8, 12, 2.5), (4, 8, 11, 1.7))]
    assert fit_served(batches) == pytest.approx((per_step, per_token))


def test_store_costs_are_the_batches_beyond_the_engine_alone_per_byte_stored():
    offload = OffloadConfig.from_extra_config(parse_kv_offload("host=1GiB,disk=/d:2GiB"))
    # 4 prompts of 100 tokens in 16-token blocks: 6 full blocks each are stored.
    assert stored_bytes((4, 100, 2), offload, 16, 1000) == 24 * 1000
    runs = {(4, 100, 2): BatchRuns([], plain_s=2.0, offload_s=2.5),
            (1, 64, 1): BatchRuns([], plain_s=1.0, offload_s=1.1)}
    stored = {(4, 100, 2): 24_000, (1, 64, 1): 4_000}
    per_byte = 0.6 / 28_000
    assert store_costs(runs, stored, offload, 1e-7) == pytest.approx(
        {"host": 1e-7, "disk": per_byte - 1e-7})
    # Host memory alone takes it all; a run no slower than the engine alone stores for free.
    host_only = OffloadConfig.from_extra_config(parse_kv_offload("host=1GiB"))
    assert store_costs(runs, stored, host_only, 1e-7) == pytest.approx({"host": per_byte})
    runs[(4, 100, 2)].offload_s = 1.0
    assert store_costs(runs, stored, host_only, 1e-7) == {"host": 0.0}


def test_fit_served_holds_at_zero_what_serving_did_not_add():
    # Served faster than the engine's steps say (a noisy machine): no negative cost.
    batches = [ServedBatch(1, 32, 1, 1, 1, 0.5, 0.4), ServedBatch(16, 32, 8, 10, 128, 3.0, 2.0)]
    assert fit_served(batches) == (0.0, 0.0)
