"""Thinking told from the answer, without a server: both parsers, finished and streamed."""

import pytest

from kvtier.entrypoints.openai.reasoning import (
    ReasoningStream,
    split_reasoning,
    thinking_closed,
)

START, END = 7, 8  # token ids of <think> and </think>


@pytest.mark.parametrize("parser, text, expected", [
    ("deepseek_r1", "plan it</think>\n\nThe answer", ("plan it", "\n\nThe answer")),
    ("deepseek_r1", "<think>plan it</think>answer", ("plan it", "answer")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),  # cut short
    ("deepseek_r1", "<think>x</think>", ("x", None)),
    ("qwen3", "\n<think>plan</think>answer", ("plan", "answer")),
    ("qwen3", "plain answer</think>", (None, "plain answer</think>")),  # never opened
    ("qwen3", "<think>unfinished", ("unfinished", None)),
    (None, "<think>a</think>b", (None, "<think>a</think>b")),
])
def test_a_finished_output_splits(parser, text, expected):
    assert split_reasoning(parser, text) == expected


@pytest.mark.parametrize("parser, text", [
    ("deepseek_r1", "step one, step two</think>\n\nFinal answer."),
    ("deepseek_r1", "<think>a</thi and on</think>done"),
    ("qwen3", "<think>hm</think>yes"),
    ("qwen3", "no thinking at all"),
    ("qwen3", "<thinking is a word>"),
])
def test_streamed_pieces_add_up_to_the_finished_split(parser, text):
    stream = ReasoningStream(parser)
    sent_reasoning, contents = "", []
    for end in range(1, len(text)):  # a character at a time, as tokens may come
        reasoning, content = stream.step(0, text[:end], finished=False)
        sent_reasoning += reasoning
        contents.append(content)
        assert "<think>" not in reasoning and "</think>" not in reasoning
    reasoning, content = stream.step(0, text, finished=True)
    expected = split_reasoning(parser, text)
    assert sent_reasoning + reasoning == (expected[0] or "")
    assert content == (expected[1] or "")
    # The content so far only grows.
    assert all(b.startswith(a) for a, b in zip(contents, contents[1:] + [content]))


def test_a_prompt_that_closed_the_thinking_leaves_the_output_all_answer():
    assert not thinking_closed([1, 2, START], START, END)  # the template opened it
    assert not thinking_closed([1, 2], START, END)  # the model may open it
    assert thinking_closed([1, START, 3, END, 4], START, END)  # thinking turned off
    assert not thinking_closed([START, END, 5, START], START, END)  # a later turn reopened
    assert split_reasoning("deepseek_r1", '{"a": 1}', closed=True) == (None, '{"a": 1}')
    stream = ReasoningStream("deepseek_r1", closed=True)
    assert stream.step(0, '{"a"', finished=False) == ("", '{"a"')
