"""`kvtier plan`: a model planned from its config.json alone, timing from a cost model file,
sweeps and their plot, and the errors a user gets."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from kvtier.entrypoints import cli
from kvtier.entrypoints.bench.trace import TraceScaling
from kvtier.planner.cost_model import CostModel, write_cost_model
from kvtier.planner.model_kv import MAX_SIMULATED_BLOCKS, model_kv
from kvtier.planner.plan import PlanConfig, run_plan

from ..tiny_models import make_hf_model

TRACE = Path(__file__).parent / "data" / "agree_trace.jsonl"
# A 70B-class Llama: 80 layers, 8 KV heads of 128: 2 * 80 * 8 * 128 * 2 bytes = 320 KiB a token.
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    make_hf_model("llama", directory, max_position_embeddings=8192)
    return str(directory)


def test_plans_a_70b_model_from_its_config_alone(tmp_path, capsys):
    (tmp_path / "llama70b").mkdir()
    (tmp_path / "llama70b" / "config.json").write_text(json.dumps(LLAMA_70B))
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--trace", str(TRACE), "--model", str(tmp_path / "llama70b"),
                     "--device-kv", "40GiB", "--kv-offload", "host=1TiB,disk=4TiB",
                     "--hits-only", "--output-json", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["working_set"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert report["working_set"]["bytes_per_block"] == 16 * 327680
    assert report["num_rejected"] == 0 and "ttft_s" not in report
    assert set(report["hit_rate"]) == {"device", "host", "disk", "total", "ceiling"}
    disk = report["working_set"]["tiers"]["disk"]["capacity_bytes"]
    # The disk file: a header page, then slots of a header page and a 5 MiB chunk each.
    chunk = 16 * 327680
    assert disk == (4 * 2**40 - 4096) // (4096 + chunk) * chunk
    # 512 tokens per hash id: whole prefixes of the trace's repeated hash ids are hit.
    assert report["hit_rate"]["device"] == pytest.approx(report["hit_rate"]["ceiling"])


def test_an_fp8_kv_cache_plans_half_the_bytes_per_token(tmp_path, capsys):
    (tmp_path / "llama70b").mkdir()
    (tmp_path / "llama70b" / "config.json").write_text(json.dumps(LLAMA_70B))
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--trace", str(TRACE), "--model", str(tmp_path / "llama70b"),
                     "--kv-cache-dtype", "fp8", "--device-kv", "40GiB", "--hits-only",
                     "--output-json", str(out)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["working_set"]["bytes_per_token"] == 2 * 80 * 8 * 128


def test_the_planned_block_is_the_engines_with_an_fp8_cache(model_dir):
    from kvtier import LLM

    llm = LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=8,
              kv_cache_dtype="fp8_e5m2")
    planned = model_kv(model_dir, 4, "float32", kv_cache_dtype="fp8_e5m2").bytes_per_block
    assert planned == sum(cache[:, 0].numel() * cache.element_size()
                          for cache in llm.engine.runner.kv_caches)
    assert planned * 4 == model_kv(model_dir, 4, "float32").bytes_per_block


def test_timing_follows_the_cost_model(model_dir, tmp_path):
    trace = tmp_path / "one.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1536, "output_length": 3, '
                     '"hash_ids": [0, 1, 2]}\n')
    cost = CostModel(0.01, 0.001, 0.002, {"host": 0.0})
    model = model_kv(model_dir, 4, "float32")
    config = PlanConfig(trace, model, 64 * model.bytes_per_block, cost=cost,
                        scaling=TraceScaling(tokens_per_block=8))
    report = run_plan(config)
    ttft = 0.01 + 24 * 0.001  # one prefill step of the 24-token prompt
    assert report["ttft_s"]["p50"] == pytest.approx(ttft)
    # Two decode steps of one sequence after the first token.
    assert report["duration_s"] == pytest.approx(ttft + 2 * (0.01 + 0.002))
    assert report["output_tokens_per_s"] == pytest.approx(3 / report["duration_s"])


def test_sweep_draws_hit_rate_against_host_size(model_dir, tmp_path, capsys):
    cost = tmp_path / "cost.json"
    write_cost_model(CostModel(0.01, 0.001, 0.002, {"host": 1e-9}), cost)
    out, plot = tmp_path / "plan.json", tmp_path / "sweep.png"
    block = model_kv(model_dir, 4, "float32").bytes_per_block
    code = cli.main(["plan", "--trace", str(TRACE), "--model", model_dir, "--dtype", "float32",
                     "--block-size", "4", "--tokens-per-block", "8",
                     "--device-kv", str(12 * block), "--kv-offload", f"host={2 * block}",
                     "--cost-model", str(cost), "--sweep", f"host={2 * block}..{16 * block}",
                     "--output-json", str(out), "--output-plot", str(plot)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    points = report["sweep"]["points"]
    assert [p["bytes"] for p in points] == [2 * block, 4 * block, 8 * block, 16 * block]
    totals = [p["hit_rate"]["total"] for p in points]
    assert totals == sorted(totals) and totals[-1] > totals[0]
    assert all(t <= report["sweep"]["ceiling"] for t in totals)
    assert points[0]["hit_rate"] == report["hit_rate"]
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("extra, message", [
    ([], "--trace and --device-kv are required"),
    (["--device-kv", "1GiB", "--model", "MODEL"], "give --cost-model FILE"),
    (["--device-kv", "1GiB", "--model", "MODEL", "--hits-only", "--sweep", "ssd=1GiB..2GiB",
      "--kv-offload", "host=1GiB"], "--sweep tier 'ssd' is not in --kv-offload"),
    (["--device-kv", "1GiB", "--model", "MODEL", "--hits-only", "--output-plot", "x.png"],
     "--output-plot draws the sweep"),
    # Each of these once had the simulation admit nothing and run forever, or said nothing.
    (["--device-kv", "1GiB", "--hits-only", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--device-kv", "1GiB", "--hits-only", "--max-num-batched-tokens", "-3"],
     "--max-num-batched-tokens must be >= 1"),
    (["--device-kv", "1GiB", "--hits-only", "--time-scale", "inf"], "--time-scale must be a "
                                                                    "finite number"),
    (["--device-kv", "1GiB", "--hits-only", "--max-model-len", "0"], "--max-model-len must be"),
    # The engine refuses it: a plan for it would count prompts the model cannot serve.
    (["--device-kv", "1GiB", "--model", "MODEL", "--hits-only", "--max-model-len", "99999999"],
     "max_model_len=99999999 is longer than the model's max_position_embeddings"),
    (["--device-kv", "1GiB", "--hits-only", "--block-size", "0"], "--block-size must be >= 1"),
    (["--device-kv", "1GiB", "--hits-only", "--output-json", "OUT_DIR"], "is a directory"),
])
def test_errors_name_the_fix(model_dir, capsys, extra, message):
    names = {"MODEL": model_dir, "OUT_DIR": model_dir}
    argv = ["plan", "--trace", str(TRACE), *[names.get(a, a) for a in extra]]
    assert cli.main(argv) == cli.USAGE_ERROR
    assert message in capsys.readouterr().err


def test_the_working_set_counts_the_served_requests_only(model_dir, tmp_path, capsys):
    reports = []
    for max_model_len in ("8192", "1500"):
        out = tmp_path / f"plan{max_model_len}.json"
        assert cli.main(["plan", "--trace", str(TRACE), "--model", model_dir, "--device-kv",
                         "1GiB", "--hits-only", "--max-model-len", max_model_len,
                         "--output-json", str(out)]) == 0, capsys.readouterr().err
        reports.append(json.loads(out.read_text()))
    everything, fewer = reports
    assert everything["num_rejected"] == 0 < fewer["num_rejected"]
    # A rejected request's blocks reach no tier.
    assert fewer["working_set"]["distinct_blocks"] < everything["working_set"]["distinct_blocks"]


def test_a_device_pool_is_capped_at_what_the_simulator_holds(model_dir):
    model = model_kv(model_dir)
    assert model.num_device_blocks(MAX_SIMULATED_BLOCKS * model.bytes_per_block) == \
        MAX_SIMULATED_BLOCKS
    with pytest.raises(ValueError, match="--device-kv .* the planner simulates at most"):
        model.num_device_blocks((MAX_SIMULATED_BLOCKS + 1) * model.bytes_per_block)


@pytest.mark.parametrize("extra, message", [
    # Each once built a pool of that many blocks or slots: allocating until killed.
    (["--device-kv", "9999999TiB"], "--device-kv .* the planner simulates at most 4194304 "
                                    "device blocks, so give at most"),
    (["--kv-offload", "host=99999TiB"], "--kv-offload: the host tier's .* the planner "
                                          "simulates at most 16777216"),
    (["--kv-offload", "host=1GiB,disk=9999999TiB"], "--kv-offload: the disk tier's"),
    (["--kv-offload", "host=1GiB", "--sweep", "host=1GiB..99999TiB"],
     "--sweep host at .* the planner simulates at most"),
    (["--kv-offload", "host=1GiB", "--sweep", "host=1..1GiB"], "--sweep host at 1 bytes: .* "
                                                                "hold no chunk"),
])
def test_sizes_past_the_simulator_fail_before_the_trace_is_read(model_dir, tmp_path, capsys,
                                                                 extra, message):
    argv = ["plan", "--trace", str(tmp_path / "not-read.jsonl"), "--model", model_dir,
            "--hits-only", "--device-kv", "1GiB", *extra]
    assert cli.main(argv) == cli.USAGE_ERROR
    assert re.search(message, capsys.readouterr().err)


def _no_server_url() -> str:
    with socket.socket() as probe:  # a port nothing listens on, once closed
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("extra, message", [
    (["--output", "TMP"], "--output TMP is a directory"),
    (["--disk-dir", "FILE"], "--disk-dir FILE is not a directory"),
    (["--served-url", "ftp://x"], r"--served-url 'ftp://x' is not an http\(s\) URL"),
    (["--served-url", "http://127.0.0.1:99999"], "--served-url .*Port out of range"),
    (["--served-url", "NO_SERVER"], "--served-url http://127.0.0.1:.*: no `kvtier serve` "
                                    "answered"),
])
def test_calibrate_checks_its_flags_before_measuring(model_dir, tmp_path, capsys, extra,
                                                     message):
    (tmp_path / "file").write_text("")
    names = {"TMP": str(tmp_path), "FILE": str(tmp_path / "file"),
             "NO_SERVER": _no_server_url()}
    argv = ["plan", "calibrate", "--model", model_dir, "--output", str(tmp_path / "cost.json"),
            *[names.get(a, a) for a in extra]]
    started = time.monotonic()
    assert cli.main(argv) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    for name, value in names.items():
        message = message.replace(name, re.escape(value))
    assert re.search(message, err), err
    assert len(err.strip().splitlines()) == 1
    assert time.monotonic() - started < 5  # not after a calibration's measuring
