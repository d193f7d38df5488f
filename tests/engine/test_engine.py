"""The Engine / LLM public API on a tiny random Llama with a word-level tokenizer."""

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.engine.errors import EngineQueueFullError

from ..tiny_models import hf_greedy, make_hf_model, save_word_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_tok")
    hf_model = make_hf_model("llama", directory)
    save_word_tokenizer(directory)
    return directory, hf_model


@pytest.fixture
def llm(model_dir):
    llm = LLM(str(model_dir[0]), dtype="float32", block_size=4, num_device_blocks=64)
    yield llm
    llm.engine.check_invariants()
    llm.engine.shutdown()


def after_prompt(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text of `ids` as it reads after the prompt's (vLLM's completion text): this
    tokenizer joins words with spaces, so it starts with one."""
    return tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]


def drain(engine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.mark.parametrize("prompt, problem", [
    ([], "empty"),
    (list(range(3, 120)) * 3, "max_model_len=252"),  # 63 usable blocks of 4
    ([5, 500], r"\[0, 128\)"),
])
def test_bad_prompts_are_refused_by_name(llm, prompt, problem):
    with pytest.raises(ValueError, match=problem):
        llm.engine.add_request("r", prompt, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_ids_are_refused_and_a_full_queue_raises(model_dir):
    llm = LLM(str(model_dir[0]), dtype="float32", block_size=4, num_device_blocks=64,
              max_waiting_requests=1)
    llm.engine.add_request("a", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="'a' is already in use"):
        llm.engine.add_request("a", PROMPT, GREEDY)
    with pytest.raises(EngineQueueFullError):
        llm.engine.add_request("b", PROMPT, GREEDY)
    assert sorted(drain(llm.engine)) == ["a"]


def test_text_prompt_without_a_tokenizer_is_refused(tmp_path):
    make_hf_model("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_device_blocks=16)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("w5 w6")


def test_text_prompts_decode_and_match_hf(llm, model_dir):
    hf_model = model_dir[1]
    out = llm.generate("w5 w6 w7 w8 w9", GREEDY)[0]
    assert out.prompt == "w5 w6 w7 w8 w9"
    assert out.prompt_token_ids == [5, 6, 7, 8, 9]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, [[5, 6, 7, 8, 9]], 6)[0]
    assert out.outputs[0].text == " " + llm.get_tokenizer().decode(out.outputs[0].token_ids)
    assert out.prompt + out.outputs[0].text == llm.get_tokenizer().decode(
        out.prompt_token_ids + out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "length"
    metrics = out.metrics
    assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time


def test_stop_strings_cut_the_text_and_finish_the_request(llm):
    tokens = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    words = llm.get_tokenizer().decode(tokens).split(" ")  # one word per token
    stop = words[3]
    first = words.index(stop)
    # The text reads as after the prompt: every word, the first too, follows a space.
    before = "".join(" " + word for word in words[:first]) + " "
    for include, text in ((False, before), (True, before + stop)):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.token_ids == tokens[:first + 1]
        assert out.text == text


def test_stop_token_ids_and_min_tokens(llm):
    tokens = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    stop_id = tokens[1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            stop_token_ids=[stop_id])
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # The stop token's text is left out of the text (token_ids keep it), unless asked for.
    tokenizer = llm.get_tokenizer()
    assert out.text == after_prompt(tokenizer, PROMPT, out.token_ids[:-1])
    params.include_stop_str_in_output = True
    kept = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    assert kept.text == after_prompt(tokenizer, PROMPT, kept.token_ids) != out.text
    # min_tokens forbids the stop id until 4 tokens exist: the greedy path changes.
    held = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                          stop_token_ids=[stop_id], min_tokens=4)
    out = llm.generate({"prompt_token_ids": PROMPT}, held)[0].outputs[0]
    assert stop_id not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_n_children_share_the_prompt_blocks(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3)
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    single = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == single for c in out.outputs)
    # Children 1 and 2 find the first 8 prompt tokens (two full blocks) cached.
    assert llm.get_metrics()["vllm:prefix_cache_hits"] >= 16


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=2)
    alone = llm.generate({"prompt_token_ids": PROMPT}, seeded)[0]
    crowd = llm.generate([{"prompt_token_ids": [20, 21, 22]}, {"prompt_token_ids": PROMPT}],
                         [SamplingParams(temperature=1.0, max_tokens=6), seeded])[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    # Child i draws with seed + i, so the two children differ.
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids


def test_a_taken_completion_id_refuses_every_completion_of_the_request(llm):
    # n > 1: completion i runs as "{i}_{id}"; one of those ids taken refuses all of them.
    llm.engine.add_request("1_x", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="'1_x'"):
        llm.engine.add_request("x", PROMPT, SamplingParams(temperature=0.0, max_tokens=2, n=2))
    assert sorted(llm.engine.scheduler.requests) == ["1_x"]
    assert sorted(drain(llm.engine)) == ["1_x"]


def test_logprobs_match_hf(llm, model_dir):
    hf_model = model_dir[1]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + out.token_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)[len(PROMPT) - 1:-1]
    assert len(out.logprobs) == 4
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top2 = expected[position].topk(2).indices.tolist()
        assert set(entry) == {token, *top2}
        for token_id, value in entry.items():
            assert value.logprob == pytest.approx(float(expected[position, token_id]),
                                                  abs=1e-4)
            rank = int((expected[position] > expected[position, token_id]).sum()) + 1
            assert value.rank == rank
            assert value.decoded_token == llm.get_tokenizer().decode([token_id])
    assert out.cumulative_logprob == pytest.approx(
        sum(float(expected[i, t]) for i, t in enumerate(out.token_ids)), abs=1e-3)
    assert out.finished()  # a method, as in vLLM
    assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0] \
        .cumulative_logprob is None  # logprobs not asked for


def _hf_prompt_logprobs(hf_model, prompt):
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)  # (len(prompt), vocab)


@pytest.mark.parametrize("chunk", [None, 3])
def test_prompt_logprobs_match_hf_and_read_no_cache(model_dir, chunk):
    """Every prompt token's logprob and the top 3 at its position, computed in one prefill or
    in chunks of 3 tokens; a prompt already in the prefix cache is computed again for them."""
    hf_model = model_dir[1]
    options = {} if chunk is None else {"max_num_batched_tokens": chunk,
                                        "enable_chunked_prefill": True}
    llm = LLM(str(model_dir[0]), dtype="float32", block_size=4, num_device_blocks=64,
              **options)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    expected = _hf_prompt_logprobs(hf_model, PROMPT)
    llm.generate({"prompt_token_ids": PROMPT}, GREEDY)  # the prompt is now cached
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        assert out.num_cached_tokens == 0
        assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
        for position, (token, entry) in enumerate(zip(PROMPT[1:], out.prompt_logprobs[1:])):
            row = expected[position]
            assert set(entry) == {token, *row.topk(3).indices.tolist()}
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert out.outputs[0].token_ids == hf_greedy(hf_model, [PROMPT], 3)[0]
    llm.engine.check_invariants()
    llm.engine.shutdown()


def test_prompt_logprobs_edge_cases(llm, model_dir):
    one = llm.generate({"prompt_token_ids": [7]}, SamplingParams(
        temperature=0.0, max_tokens=2, prompt_logprobs=0, n=2))[0]
    assert one.prompt_logprobs == [None]
    full = llm.generate({"prompt_token_ids": PROMPT[:3]}, SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=-1))[0]
    assert [len(entry) for entry in full.prompt_logprobs[1:]] == [128, 128]  # the vocabulary
    assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs must be <= the vocabulary"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(prompt_logprobs=129))


def test_chat_renders_the_template(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "w7 w8"}]
    out = llm.chat(messages, GREEDY)[0]
    rendered = tokenizer.apply_chat_template(messages)
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids == [1, 3, 7, 8, 2, 1, 4]


def test_chat_takes_text_parts_and_the_servers_chat_options(llm):
    tokenizer = llm.get_tokenizer()
    plain = llm.chat([{"role": "user", "content": "w7 w8"}], GREEDY)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w7 w8"}]}],
                     GREEDY)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    assert plain.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "w7 w8"}])
    messages = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8 w9"}]
    opened = llm.chat(messages, GREEDY, add_generation_prompt=False,
                      continue_final_message=True)[0]
    assert opened.prompt.endswith("assistant w8 w9")  # not closed by the template's </s>
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt"):
        llm.chat(messages, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="content part type 'image_url' is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 GREEDY)


def test_chat_hands_tools_to_the_template(llm):
    tokenizer = llm.get_tokenizer()
    original = tokenizer.chat_template
    tokenizer.set_chat_template("{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
                                "{{ messages[0].content }}")
    try:
        tools = [{"type": "function", "function": {"name": "w9"}}]
        with_tools = llm.chat([{"role": "user", "content": "w7"}], GREEDY, tools=tools)[0]
        without = llm.chat([{"role": "user", "content": "w7"}], GREEDY)[0]
    finally:
        tokenizer.set_chat_template(original)
    assert (with_tools.prompt, without.prompt) == ("w9 w7", "w7")


def test_prompt_dicts_take_a_cache_salt_and_refuse_other_keys(llm):
    salted = {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}
    assert llm.generate(salted, GREEDY)[0].num_cached_tokens == 0
    assert llm.generate(salted, GREEDY)[0].num_cached_tokens == 8
    # Another salt, or none, shares nothing with it.
    assert llm.generate({**salted, "cache_salt": "tenant-b"}, GREEDY)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {}}, GREEDY)


def test_abort_frees_the_request(llm):
    engine = llm.engine
    engine.add_request("keep", PROMPT, GREEDY)
    engine.add_request("drop", [30, 31, 32, 33, 34], GREEDY)
    engine.step()
    engine.abort_request(["drop", "unknown"])
    finished = drain(engine)
    assert sorted(finished) == ["keep"]
    metrics = llm.get_metrics()
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics['vllm:request_success{finished_reason="length"}'] == 1


def test_repeated_prompt_reports_cached_tokens_and_reset_clears(llm):
    first = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    second = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 8
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    third = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    assert third.num_cached_tokens == 0


def test_a_refused_prompt_in_a_batch_leaves_no_request_behind(llm):
    # Bug fixed in review: the prompts added before the bad one stayed queued and ran (unseen)
    # in the next generate() call.
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": []}], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6]


def test_every_step_that_computed_is_timed_once(llm):
    # One request whose prompt fits one step: the first token comes with its prefill, each
    # other token with one decode step, so 6 tokens are 6 steps.
    llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)
    metrics = llm.get_metrics()
    assert metrics["kvtier:engine_step_seconds_count"] == GREEDY.max_tokens
    assert metrics["kvtier:engine_step_seconds_sum"] > 0
    llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:5]}], GREEDY)
    # Both start in the same step and decode side by side: 6 more steps, not 12.
    assert llm.get_metrics()["kvtier:engine_step_seconds_count"] == 2 * GREEDY.max_tokens


def test_per_token_and_per_request_series_count_every_completion(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=2)
    llm.generate({"prompt_token_ids": PROMPT}, params)
    metrics = llm.get_metrics()
    assert (metrics["vllm:request_prompt_tokens_count"],
            metrics["vllm:request_prompt_tokens_sum"]) == (1, len(PROMPT))
    assert (metrics["vllm:request_generation_tokens_count"],
            metrics["vllm:request_generation_tokens_sum"]) == (2, 10)
    assert metrics["vllm:request_time_per_output_token_seconds_count"] == 2
    assert metrics["vllm:inter_token_latency_seconds_count"] == 2 * 4  # after each first token
    assert [key for key in metrics if key.startswith("vllm:cache_config_info")] == [
        'vllm:cache_config_info{block_size="4",num_gpu_blocks="64",'
        'enable_prefix_caching="True",cache_dtype="float32"}']


def test_bad_words_are_never_generated(llm):
    """Greedy output with a word of it banned: the word never appears, and the output up to
    where it first stood is unchanged."""
    tokenizer = llm.get_tokenizer()
    plain = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    banned = plain[2]
    word = tokenizer.decode([banned])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, bad_words=[word])
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
    assert banned not in out and out[:2] == plain[:2]
    with pytest.raises(ValueError, match="makes no token"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(bad_words=[" "]))
