"""--reasoning-parser through a real server: a tiny random Llama whose tokenizer has <think>
and </think>, and a chat template that opens the thinking (as DeepSeek-R1's does)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvtier.entrypoints.openai.reasoning import split_reasoning

from ..tiny_models import THINK_END_ID, make_hf_model
from .server_process import ServerProcess

MODEL = "thinker"
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant: <think>{% endif %}")
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinker")
    make_hf_model("llama", directory, tokenizer="thinking")
    template = directory / "template.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess(str(directory), "--served-model-name", MODEL,
                         "--num-device-blocks", "64", "--block-size", "16",
                         "--max-model-len", "256", "--chat-template", str(template),
                         "--reasoning-parser", "deepseek_r1")
    yield proc
    proc.stop()


def chat(server, **fields) -> dict:
    response = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 16, "temperature": 0.0, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def streamed(server, **fields) -> tuple[str, str, list[dict]]:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60.0, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
            "max_tokens": 16, "temperature": 0.0, "stream": True, **fields}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return ("".join(d.get("reasoning") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), chunks)


def raw_text(server, token_ids: list[int]) -> str:
    return server.post("/detokenize", {"model": MODEL, "tokens": token_ids}).json()["prompt"]


def test_the_output_splits_as_the_parser_reads_it(server):
    choice = chat(server, return_token_ids=True)
    text = raw_text(server, choice["token_ids"])
    message = choice["message"]
    assert (message.get("reasoning"), message["content"]) == split_reasoning("deepseek_r1", text)
    assert message.get("reasoning")  # a thinking template: the output starts as reasoning


def test_a_constraint_holds_the_answer_after_the_thinking(server):
    # The bias makes </think> the first token; the choice then holds the answer.
    fields = {"logit_bias": {str(THINK_END_ID): 100}, "structured_outputs": {"choice": CHOICES}}
    message = chat(server, **fields)["message"]
    assert message["content"] in CHOICES and message.get("reasoning") == ""
    reasoning, content, chunks = streamed(server, **fields)
    assert (reasoning, content) == ("", message["content"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stream_sends_the_same_split(server):
    message = chat(server)["message"]
    reasoning, content, _ = streamed(server)
    assert (reasoning, content or None) == (message.get("reasoning"), message["content"])


def test_include_reasoning_false_leaves_the_thinking_out(server):
    message = chat(server, include_reasoning=False)["message"]
    assert "reasoning" not in message
    reasoning, _, _ = streamed(server, include_reasoning=False)
    assert reasoning == ""


def test_a_model_without_thinking_tokens_is_refused_at_start(tiny_model):
    with pytest.raises(RuntimeError, match="has no <think> and </think> tokens"):
        ServerProcess(tiny_model[0], "--num-device-blocks", "64", "--reasoning-parser", "qwen3")


def test_include_reasoning_false_hides_the_thinking_in_logprobs_and_token_ids_too(server):
    choice = chat(server, include_reasoning=False, logprobs=True, top_logprobs=1,
                  return_token_ids=True)
    assert choice["logprobs"] is None and "token_ids" not in choice


def test_a_constraint_with_logprobs_reports_ruled_out_tokens_as_minus_9999(server):
    fields = {"logit_bias": {str(THINK_END_ID): 100}, "structured_outputs": {"choice": CHOICES},
              "logprobs": True, "top_logprobs": 5}
    content = chat(server, **fields)["logprobs"]["content"]
    tops = [top["logprob"] for entry in content for top in entry["top_logprobs"]]
    assert -9999.0 in tops and all(value >= -9999.0 for value in tops)


def respond(server, **fields) -> dict:
    response = server.post("/v1/responses", {
        "model": MODEL, "input": "Think, then answer.", "max_output_tokens": 16,
        "temperature": 0.0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_responses_give_the_thinking_as_a_reasoning_item(server):
    choice = chat(server, return_token_ids=True)
    body = respond(server)
    reasoning, *rest = body["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text",
                                     "text": choice["message"]["reasoning"]}]
    text = "".join(part["text"] for item in rest for part in item["content"])
    assert text == (choice["message"]["content"] or "")
    ids = choice["token_ids"]
    thinking = ids.index(THINK_END_ID) + 1 if THINK_END_ID in ids else len(ids)
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == thinking


def test_a_streamed_response_sends_the_thinking_as_reasoning_text_events(server):
    body = respond(server)
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60.0, json={
            "model": MODEL, "input": "Think, then answer.", "max_output_tokens": 16,
            "temperature": 0.0, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == body["output"][0]["content"][0]["text"]
    assert events[2]["type"] == "response.output_item.added"
    assert events[2]["item"]["type"] == "reasoning"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == \
        [item["type"] for item in body["output"]]


def test_response_logprobs_are_the_answers_not_the_thinkings(server):
    # The bias ends the thinking after a few tokens, so the answer has text of its own.
    fields = {"include": ["message.output_text.logprobs"], "top_logprobs": 1,
              "max_output_tokens": 24, "logit_bias": {str(THINK_END_ID): 8}}
    body = respond(server, **fields)
    usage = body["usage"]
    answer = [len(part["logprobs"]) for item in body["output"] if item["type"] == "message"
              for part in item["content"]]
    assert answer == [usage["output_tokens"] - usage["output_tokens_details"]["reasoning_tokens"]]
    assert usage["output_tokens_details"]["reasoning_tokens"] > 0 and answer[0] > 0
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60.0, json={
            "model": MODEL, "input": "Think, then answer.", "temperature": 0.0,
            "stream": True, **fields}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    streamed = sum(len(e["logprobs"]) for e in events if e["type"] == "response.output_text.delta")
    assert streamed == answer[0]


def anthropic_events(server, **fields) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=60.0, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
            "max_tokens": 40, "temperature": 0.0, "stream": True, **fields}) as response:
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ")]


def test_messages_give_the_thinking_as_a_thinking_block_streamed_or_not(server):
    # The bias ends the thinking after a few tokens, so the answer has text of its own.
    fields = {"logit_bias": {str(THINK_END_ID): 3.25}}
    message = chat(server, max_tokens=40, **fields)["message"]
    response = server.post("/v1/messages", {
        "model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 40, "temperature": 0.0, **fields})
    blocks = response.json()["content"]
    assert message["reasoning"] and message["content"]
    assert blocks == [{"type": "thinking", "thinking": message["reasoning"], "signature": ""},
                      {"type": "text", "text": message["content"], "citations": None}]
    events = anthropic_events(server, **fields)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("text", "") for d in deltas) == message["content"]
