"""LoRA adapters in the engine, token for token against PEFT on HF transformers (fp32): several
adapters and the base model in one batch, the adapter-seat limit, the prefix cache and the
offloading tiers keeping each adapter's KV apart, speculative decoding, other architectures."""

from __future__ import annotations

import pytest

from kvtier import LLM, LoRARequest, SamplingParams
from kvtier.lora.layers import LoRABatch
from tests.lora.adapters import make_adapter
from tests.tiny_models import hf_greedy, make_hf_model, make_lfm2_model, make_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The base model and three adapters: every projection at rank 4; q/v only at rank 8
    with rsLoRA scaling; and ranks that differ within fused modules (rank_pattern: q and
    gate at 8, the rest at 2, so their scalings differ too)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_hf_model("llama", root / "base")
    models = {None: base,
              "all": make_adapter(base, root / "all", seed=1),
              "qv": make_adapter(base, root / "qv", seed=2, targets=("q_proj", "v_proj"), r=8,
                                 use_rslora=True),
              "ranks": make_adapter(base, root / "ranks", seed=4, r=2,
                                    rank_pattern={"q_proj": 8, "gate_proj": 8})}
    requests = {name: LoRARequest(name, index + 1, str(root / name))
                for index, name in enumerate(["all", "qv", "ranks"])}
    requests[None] = None
    return root, models, requests


def _expected(models, names, prompts):
    return [hf_greedy(models[name], [prompt], MAX_TOKENS)[0]
            for name, prompt in zip(names, prompts)]


def _generate(llm, requests, names, prompts, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=[requests[name] for name in names])
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_adapters_and_base_in_one_batch_match_peft(llama, max_loras, monkeypatch):
    root, models, requests = llama
    # Every prompt with each adapter and without: the shared prefixes of make_prompts would
    # hit another adapter's blocks if the prefix cache mixed them up.
    prompts = [p for p in make_prompts() for _ in range(4)]
    names = [None, "all", "qv", "ranks"] * (len(prompts) // 4)
    seen: list[int] = []
    stacked: list[bool] = []
    begin = LoRABatch.begin_step

    def record(self, adapters, query_start):
        seen.append(len({a.name for a in adapters if a is not None}))
        begin(self, adapters, query_start)
        stacked.append(self.stacked is not None)

    monkeypatch.setattr(LoRABatch, "begin_step", record)
    llm = LLM(str(root / "base"), dtype="float32", block_size=4, enable_lora=True,
              max_loras=max_loras, max_num_batched_tokens=64)
    assert _generate(llm, requests, names, prompts) == _expected(models, names, prompts)
    assert max(seen) == max_loras  # the seat limit binds, and is never passed
    # Two adapters: decode steps stack them, prefill steps with uneven rows do not.
    assert set(stacked) == ({False} if max_loras == 1 else {True, False})
    llm.engine.check_invariants()


def test_each_adapter_has_its_own_prefix_cache(llama):
    root, models, requests = llama
    prompt = make_prompts()[2]  # 33 tokens: 8 full blocks
    llm = LLM(str(root / "base"), dtype="float32", block_size=4, enable_lora=True)
    for name in ("all", None, "qv", "all"):
        [output] = llm.generate([{"prompt_token_ids": prompt}], GREEDY,
                                lora_request=requests[name])
        assert output.outputs[0].token_ids == _expected(models, [name], [prompt])[0], name
        # Only the second "all" finds blocks: its own adapter's, computed first.
        assert output.num_cached_tokens == (32 if name == "all" and output.request_id == "3"
                                             else 0), name
    llm.engine.check_invariants()


def test_offloaded_adapter_kv_reloads_and_another_adapter_of_that_name_misses(llama,
                                                                            tmp_path):
    """Two engines share an fs tier. The first stores prompt KV of adapter "all" under the
    name "shared"; the second has adapter "qv" under that same name: it must find nothing (a
    hit would give it the other adapter's KV) and match PEFT's "qv" tokens."""
    root, models, _ = llama
    prompt = make_prompts()[3]
    options = dict(dtype="float32", block_size=4, enable_lora=True, num_device_blocks=24,
                   kv_offload=f"host=1MiB,fs={tmp_path}")
    first = LoRARequest("shared", 1, str(root / "all"))
    with LLM(str(root / "base"), **options) as llm:
        assert _generate(llm, {"x": first}, ["x"], [prompt]) == \
            _expected(models, ["all"], [prompt])
        # Push it out of device memory, then back from the host tier.
        _generate(llm, {None: None}, [None] * 3, make_prompts(seed=5)[:3])
        [again] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=first)
        assert again.num_cached_tokens == 32
        assert again.outputs[0].token_ids == _expected(models, ["all"], [prompt])[0]
    second = LoRARequest("shared", 1, str(root / "qv"))
    with LLM(str(root / "base"), **options) as llm:
        [output] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=second)
        assert output.num_cached_tokens == 0
        assert output.outputs[0].token_ids == _expected(models, ["qv"], [prompt])[0]


def test_speculative_decoding_with_an_adapter(llama):
    root, models, requests = llama
    prompts = [p * 3 for p in make_prompts()[:3]]  # repeats: the n-gram drafts find matches
    names = ["all", None, "qv"]
    llm = LLM(str(root / "base"), dtype="float32", block_size=4, enable_lora=True,
              max_loras=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert _generate(llm, requests, names, prompts) == _expected(models, names, prompts)
    assert llm.get_metrics()["vllm:spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "lfm2"])
def test_other_architectures(arch, tmp_path):
    """Qwen3 (q/k norms, head_dim apart from hidden size), Mistral (sliding window), LFM2
    (HF names renamed onto kvtier's modules, convolution layers' MLPs adapted too)."""
    if arch == "lfm2":
        base = make_lfm2_model("conv_attn", tmp_path / "base")
        targets = ("q_proj", "k_proj", "v_proj", "self_attn.out_proj", "w1", "w2", "w3")
    else:
        base = make_hf_model(arch, tmp_path / "base")
        targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj")
    models = {None: base, "a": make_adapter(base, tmp_path / "a", seed=3, targets=targets)}
    prompts, names = make_prompts()[:4], ["a", None, "a", None]
    llm = LLM(str(tmp_path / "base"), dtype="float32", block_size=4, enable_lora=True)
    requests = {None: None, "a": LoRARequest("a", 1, str(tmp_path / "a"))}
    assert _generate(llm, requests, names, prompts) == _expected(models, names, prompts)


def test_lora_requests_info_names_running_and_waiting_adapters(llama):
    """vLLM's vllm:lora_requests_info: with one seat, "all" runs while "qv" waits; one series."""
    root, _, requests = llama
    llm = LLM(str(root / "base"), dtype="float32", block_size=4, enable_lora=True)
    engine = llm.engine
    for index, name in enumerate(["all", "qv", None]):
        engine.add_request(str(index), make_prompts()[index], GREEDY,
                           lora_request=requests[name])
    engine.step()
    series = [key for key in llm.get_metrics() if key.startswith("vllm:lora_requests_info")]
    assert series == ['vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="qv",'
                      'running_lora_adapters="all"}']
    while engine.has_unfinished_requests():
        engine.step()
    series = [key for key in llm.get_metrics() if key.startswith("vllm:lora_requests_info")]
    assert series == ['vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",'
                      'running_lora_adapters=""}']


def test_a_request_waiting_for_a_seat_is_not_overtaken(llama):
    """One seat, "all" holding it, a "qv" request waiting, and a new "all" request every step:
    the later "all" requests wait behind the "qv" one, so the seat frees and it runs."""
    root, _, requests = llama
    llm = LLM(str(root / "base"), dtype="float32", block_size=4, enable_lora=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("first", make_prompts()[0], params, lora_request=requests["all"])
    engine.add_request("waiting", make_prompts()[1], params, lora_request=requests["qv"])
    finished: list[str] = []
    for step in range(30):
        engine.add_request(f"later{step}", make_prompts()[2], params,
                           lora_request=requests["all"])
        finished += [o.request_id for o in engine.step() if o.finished]
        if "waiting" in finished:
            break
    assert "waiting" in finished and finished.index("waiting") <= 2, finished
    engine.abort_request([f"later{s}" for s in range(30)])


def test_max_cpu_loras_drops_the_least_recently_used_and_loads_it_again(llama):
    root, models, requests = llama
    llm = LLM(str(root / "base"), dtype="float32", block_size=4, enable_lora=True,
              max_cpu_loras=1)
    prompt = make_prompts()[0]
    for name in ("all", "qv", "all", "ranks"):
        assert _generate(llm, requests, [name], [prompt]) == \
            _expected(models, [name], [prompt]), name
        assert [a.name for a in llm.engine.loras.adapters()] == [name]
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        LLM(str(root / "base"), enable_lora=True, max_loras=2, max_cpu_loras=1)
