"""One request never hurts another: bad token ids are refused before they reach a batch, a
request that fails while its step is processed ends alone, and the context length always fits
the device KV cache (a tiny random Llama with a word-level tokenizer, fp32)."""

from __future__ import annotations

import logging

import pytest

from kvtier import LLM, SamplingParams
from kvtier.models.detokenizer import IncrementalDetokenizer

from ..tiny_models import make_hf_model

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37], [41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=8, ignore_eos=True)
# Sampled after min_tokens is reached: the request with this stop id stays live a few steps.
OUT_OF_VOCAB = 1_000_000_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_words")
    make_hf_model("llama", directory, tokenizer="words")
    return str(directory)


@pytest.fixture
def llm(model_dir):
    llm = LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=64)
    yield llm
    llm.engine.check_invariants()
    llm.engine.shutdown()


def drain(engine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def tokens_of(outputs: dict) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items()}


def run_batch(engine, params: list[SamplingParams], broken: str | None = None,
              break_request=None) -> dict:
    """Every prompt as request r0..r3; `break_request(engine, id)` then breaks one of them."""
    for index, (prompt, request_params) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{index}", prompt, request_params)
    if broken is not None:
        break_request(engine, broken)
    return drain(engine)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[OUT_OF_VOCAB]),
     "stop_token_ids holds token id 1000000000"),
    (SamplingParams(max_tokens=5, logprobs=1000), "logprobs must be <= the vocabulary"),
])
def test_token_ids_outside_the_vocabulary_are_refused(llm, params, field):
    # Before: the stop id failed the whole sampling step (IndexError) for every request in it.
    with pytest.raises(ValueError, match=field):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)[0].finished


@pytest.mark.parametrize("prompt", [[11, OUT_OF_VOCAB], [-1, 11], [11, "12"], [11, True]])
def test_prompt_token_ids_must_be_ints_in_the_vocabulary(llm, prompt):
    with pytest.raises(ValueError, match=r"prompt token ids must be ints in \[0, "):
        llm.engine.add_request("bad", prompt, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)[0].finished


def test_a_negative_stop_token_id_is_refused():
    with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


@pytest.mark.parametrize("fields, name", [
    ({"seed": 2 ** 64}, "seed"),  # past what a generator takes
    ({"seed": 2 ** 64 - 1, "n": 2}, "seed"),  # completion 1 would draw with seed + 1
    ({"max_tokens": 2.5}, "max_tokens"), ({"n": "2"}, "n"), ({"top_k": 1.5}, "top_k"),
    ({"logprobs": True}, "logprobs"), ({"temperature": None}, "temperature"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"stop": 5}, "stop"),
])
def test_a_value_of_the_wrong_type_or_range_is_refused_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name} must be"):
        SamplingParams(**fields)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []  # None: no stops
    assert SamplingParams(stop=("a",), stop_token_ids=(3,)).stop_token_ids == [3]


def test_a_step_that_raises_leaves_no_request_of_that_call_behind(llm, monkeypatch):
    def broken_step():
        raise RuntimeError("the step failed")

    with monkeypatch.context() as patch:
        patch.setattr(llm.engine, "step", broken_step)
        with pytest.raises(RuntimeError, match="the step failed"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)[0].outputs[0].token_ids) \
        == 8  # the next call runs


def test_a_forward_pass_that_raises_leaves_no_unwritten_block_in_the_prefix_cache(
        llm, monkeypatch):
    """The blocks of a failed step are hashed when handed out, before the forward pass
    writes them: a later request with the same prompt must compute it, not read them."""
    prompt = list(range(11, 31))  # 5 full blocks of 4
    expected = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    assert llm.reset_prefix_cache()
    forward = llm.engine.runner.model.forward
    calls = []

    def forward_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device error")
        return forward(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner.model, "forward", forward_failing_once)
    with pytest.raises(RuntimeError, match="device error"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY)
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == expected


def _break_sampling(engine, request_id: str) -> None:
    # What a token id the edge checks missed would do: index past the logits in the sampler.
    params = engine.scheduler.requests[request_id].sampling_params
    params.stop_token_ids.append(OUT_OF_VOCAB)
    params.min_tokens = 4


class _FailingDetokenizer(IncrementalDetokenizer):
    """The real detokenizer, failing on its third step (a tokenizer bug for some token)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_special_tokens=True)
        self.num_steps = 0

    def step(self, token_ids):
        self.num_steps += 1
        if self.num_steps == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return super().step(token_ids)


def _break_detokenizer(engine, request_id: str) -> None:
    child = engine._outputs.parents[request_id].children[0]
    child.detokenizer = _FailingDetokenizer(engine.tokenizer)


@pytest.mark.parametrize("break_request, message", [
    (_break_sampling, "sampling failed: IndexError"),
    (_break_detokenizer, "output processing failed: UnicodeDecodeError"),
])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_failing_in_its_step_ends_alone(llm, params, break_request, message):
    alone = tokens_of(run_batch(llm.engine, [params] * 4))
    finished = run_batch(llm.engine, [params] * 4, "r2", break_request)
    failed = finished.pop("r2")
    assert failed.outputs[0].finish_reason == "error"
    assert message in failed.error
    # The others ran in the same batches and got exactly what they get without the failure.
    assert tokens_of(finished) == {rid: tokens for rid, tokens in alone.items() if rid != "r2"}
    assert all(out.outputs[0].finish_reason == "length" for out in finished.values())
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_a_failing_child_ends_its_siblings(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=3)
    llm.engine.add_request("parent", PROMPTS[0], params)
    llm.engine.add_request("other", PROMPTS[1], GREEDY)
    _break_sampling(llm.engine, "1_parent")
    finished = drain(llm.engine)
    assert [c.finish_reason for c in finished["parent"].outputs] == ["error"] * 3
    assert len(finished["other"].outputs[0].token_ids) == 8
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_an_unset_max_model_len_is_lowered_to_what_the_cache_holds(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.runtime"):
        llm = LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=16)
    # 15 usable blocks of 4 tokens (the null block is never handed out), model allows 256.
    assert llm.engine.max_model_len == 60
    assert "max_model_len is lowered to 60" in caplog.text
    # Before: accepted, never admitted, and every later request waited behind it.
    with pytest.raises(ValueError, match="max_model_len=60"):
        llm.engine.add_request("long", list(range(5, 66)), GREEDY)
    out = llm.generate({"prompt_token_ids": list(range(5, 55))}, SamplingParams(
        temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (10, "length")


def test_an_asked_max_model_len_that_does_not_fit_is_an_error(model_dir):
    with pytest.raises(ValueError, match=r"max_model_len=256 does not fit .*--max-model-len "
                                         r"to at most 60.*--num-device-blocks"):
        LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=16, max_model_len=256)


def test_every_kv_cache_group_needs_its_own_block_table(tmp_path):
    # Qwen2 here: one full-attention and one sliding-window group in one pool. A prompt is
    # admitted only once both groups have blocks for all of it.
    make_hf_model("qwen2", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=24)
    assert llm.engine.max_model_len == 44  # 23 usable blocks: 11 per group
    out = llm.generate({"prompt_token_ids": list(range(5, 48))}, SamplingParams(
        temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (1, "length")
