"""Structured outputs in the engine, token for token against HF transformers (fp32, greedy, a
tiny random Llama with a byte-level tokenizer): the reference masks HF's logits with the
tokens that keep the text inside the constraint's (finite) language, computed here from the
language itself, not by the grammar library."""

import itertools
import json

import pytest
import torch
from tokenizers import Tokenizer

from kvtier import LLM, SamplingParams
from kvtier.structured_output import GrammarError

from ..tiny_models import BYTE_EOS_ID, make_hf_model

CHOICES = ["yes", "no", "nothing", "maybe so"]
# The regex and the finite language it matches.
REGEX = r"[0-2]{2}-(x|yz)"
REGEX_LANGUAGE = [f"{a}{b}-{c}" for a, b, c in itertools.product("012", "012", ["x", "yz"])]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "kind": {"enum": ["a", "bb"]}},
          "required": ["ok", "kind"], "additionalProperties": False}
PROMPTS = ["Answer: ", "The code is ", "JSON please", "Pick one of these now: "]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_bytes")
    model = make_hf_model("llama", directory, tokenizer="bytes")
    return str(directory), model, Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def llm(reference):
    # Small blocks and budget: prompts prefill in chunks, batched with each other's decodes.
    llm = LLM(reference[0], dtype="float32", block_size=4, num_device_blocks=128,
              max_num_batched_tokens=16)
    yield llm
    llm.engine.shutdown()


def hf_constrained_greedy(model, tokenizer, prompt: str, language: list[str]) -> str:
    """HF's greedy text where each step may only pick a token that keeps the text a prefix of
    a word of `language`, or EOS once the text is one."""
    ids = tokenizer.encode(prompt).ids
    text = ""
    with torch.no_grad():
        while True:
            allowed = {tokenizer.encode(word[len(text)]).ids[0] for word in language
                       if word.startswith(text) and len(word) > len(text)}
            if text in language:
                allowed.add(BYTE_EOS_ID)
            logits = model(torch.tensor([ids])).logits[0, -1]
            masked = torch.full_like(logits, float("-inf"))
            masked[list(allowed)] = logits[list(allowed)]
            token = int(masked.argmax())
            if token == BYTE_EOS_ID:
                return text
            ids.append(token)
            text = tokenizer.decode(tokenizer.encode(text).ids + [token])


def test_choice_and_regex_match_hf_masked_by_the_language(reference, llm):
    _, model, tokenizer = reference
    constraints = [({"choice": CHOICES}, CHOICES), ({"regex": REGEX}, REGEX_LANGUAGE)]
    cases = [(prompt, so, language) for prompt in PROMPTS for so, language in constraints]
    params = [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so)
              for _, so, _ in cases]
    outputs = llm.generate([prompt for prompt, _, _ in cases], params)
    llm.engine.check_invariants()
    for (prompt, _, language), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.text == hf_constrained_greedy(model, tokenizer, prompt, language)
        assert completion.text in language


def test_unconstrained_requests_in_the_batch_are_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].text for o in llm.generate(PROMPTS, plain)]
    constrained = SamplingParams(temperature=0.0, max_tokens=12,
                                 structured_outputs={"choice": CHOICES})
    mixed = llm.generate([p for prompt in PROMPTS for p in (prompt, prompt)],
                         [p for _ in PROMPTS for p in (plain, constrained)])
    assert [o.outputs[0].text for o in mixed[0::2]] == alone
    assert all(o.outputs[0].text in CHOICES for o in mixed[1::2])


def test_json_schema_output_is_valid_json_of_the_schema(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={
        "json": json.dumps(SCHEMA), "disable_any_whitespace": True})
    for output in llm.generate(PROMPTS, params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        assert set(value) == {"ok", "kind"}
        assert isinstance(value["ok"], bool) and value["kind"] in ("a", "bb")
        assert " " not in completion.text


def test_sampled_completions_each_follow_their_own_grammar(llm):
    # n completions share the prompt but not the grammar's state: a copy each.
    params = SamplingParams(temperature=1.5, seed=7, n=6, max_tokens=20,
                            structured_outputs={"regex": REGEX})
    texts = [c.text for c in llm.generate(["Go: "], params)[0].outputs]
    assert all(text in REGEX_LANGUAGE for text in texts)
    assert len(set(texts)) > 1  # sampled, not one greedy answer six times


def test_grammars_survive_preemption(reference):
    _, model, tokenizer = reference
    # 12 blocks of 4 tokens cannot hold the batch: requests are preempted and recomputed.
    llm = LLM(reference[0], dtype="float32", block_size=4, num_device_blocks=12,
              max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20,
                                structured_outputs={"choice": CHOICES})
        outputs = llm.generate(PROMPTS * 2, params)
        assert llm.get_metrics()["vllm:num_preemptions"] > 0
        for prompt, output in zip(PROMPTS * 2, outputs):
            assert output.outputs[0].text == hf_constrained_greedy(model, tokenizer, prompt,
                                                                   CHOICES)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("constraint, message", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json is invalid"),
    ({"json": "{not json"}, "structured_outputs.json is invalid: not JSON"),
    ({"regex": "[a-"}, "structured_outputs.regex is invalid"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar is invalid"),
    # Compiles, but fails at its first mask (it matches nothing).
    ({"regex": "[^\\s\\S]"}, "structured_outputs.regex is invalid"),
])
def test_a_constraint_that_does_not_compile_is_refused_at_add(llm, constraint, message):
    with pytest.raises(GrammarError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_past_the_grammar_fails_that_request_alone(llm, temperature):
    # The choice ends after 2 tokens; min_tokens forbids the EOS it then allows.
    stuck = SamplingParams(temperature=temperature, max_tokens=20, min_tokens=6,
                           structured_outputs={"choice": ["no"]})
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["Q: "], seeded)[0].outputs[0].token_ids
    failed, other = llm.generate(["Q: ", "Q: "], [stuck, seeded])
    assert failed.outputs[0].finish_reason == "error"
    assert "no token is allowed" in failed.error
    # The failing row drew no noise: the seeded neighbour draws what it draws alone.
    assert other.outputs[0].token_ids == alone
    llm.engine.check_invariants()


def test_a_token_dropped_after_a_failed_load_is_taken_back_from_the_grammar(reference,
                                                                           monkeypatch):
    # The host tier's load fails (recompute policy): the scheduler drops the token sampled on
    # the bad KV and computes again; the grammar must not stay a token ahead.
    import time

    import kvtier.connector.offloading.worker as offload_worker

    failing = {"on": False}
    run_loads = offload_worker.OffloadingConnectorWorker._run_loads
    monkeypatch.setattr(offload_worker.OffloadingConnectorWorker, "_run_loads",
                        lambda self, direction, loads: False if failing["on"]
                        else run_loads(self, direction, loads))
    llm = LLM(reference[0], dtype="float32", block_size=4, num_device_blocks=64,
              max_num_batched_tokens=64, kv_offload="host=64MiB")
    try:
        prompt = "x" * 40 + " Spell it: "
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))  # stored on host
        time.sleep(0.5)
        assert llm.reset_prefix_cache()
        failing["on"] = True
        params = SamplingParams(temperature=0.0, max_tokens=20,
                                structured_outputs={"regex": "abcdefghij"})
        assert llm.generate(prompt, params)[0].outputs[0].text == "abcdefghij"
    finally:
        llm.engine.shutdown()
