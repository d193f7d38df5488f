"""A completion's text reads as it does after the prompt, streamed and final alike, for a
SentencePiece-style tokenizer (whose decoder strips the leading space of a text's first token)
and for byte-level BPE, on a tiny random Llama."""

import pytest

from kvtier import LLM, SamplingParams

from ..models.sentencepiece_tokenizer import ID, save_sentencepiece_tokenizer
from ..tiny_models import make_hf_model

PROMPT = [ID["<s>"], ID["▁The"], ID["▁capital"], ID["▁of"], ID["▁France"], ID["▁is"]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def sentencepiece_llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_sp")
    make_hf_model("llama", directory)
    backend = save_sentencepiece_tokenizer(directory)
    llm = LLM(str(directory), dtype="float32", block_size=4, num_device_blocks=64)
    yield llm, backend
    llm.engine.shutdown()


def stream(engine, prompt: list[int], params: SamplingParams) -> list[str]:
    """The completion's text after each step that brought it more."""
    engine.add_request("r", prompt, params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [out.outputs[0].text for out in engine.step()]
    engine.check_invariants()
    return texts


def after_prompt(backend, prompt: list[int], output: list[int]) -> str:
    return backend.decode(prompt + output)[len(backend.decode(prompt)):]


def test_first_word_keeps_its_space_streamed_and_final(sentencepiece_llm):
    """Before, the first word lost its space: "Paris" where vLLM gives " Paris"."""
    llm, backend = sentencepiece_llm
    forced = SamplingParams(temperature=0.0, max_tokens=2, allowed_token_ids=[ID["▁Paris"]])
    assert llm.generate({"prompt_token_ids": PROMPT}, forced)[0].outputs[0].text == " Paris Paris"
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0]
    assert out.text == after_prompt(backend, PROMPT, out.token_ids)
    assert out.text.startswith(" ") and out.text.strip() == backend.decode(out.token_ids)
    texts = stream(llm.engine, PROMPT, GREEDY)
    assert texts[-1] == out.text
    # Streamed text only grows: a client's deltas add up to the final text.
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_spaced_text(sentencepiece_llm, include):
    llm, backend = sentencepiece_llm
    tokens = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    stop = backend.decode(tokens[2:3])
    first = tokens.index(tokens[2])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    texts = stream(llm.engine, PROMPT, params)
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    before = after_prompt(backend, PROMPT, tokens[:first])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == texts[-1] == before + (" " + stop if include else " ")
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))


def test_byte_level_text_is_the_output_alone(tmp_path):
    make_hf_model("llama", tmp_path, tokenizer="bytes")
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=64)
    tokenizer = llm.get_tokenizer()
    for prompt in ("héllo 世界", "x é"):
        ids = tokenizer.encode(prompt)
        out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
        assert out.text == tokenizer.decode(out.token_ids)
    llm.engine.shutdown()
