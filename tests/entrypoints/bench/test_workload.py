"""The multi-turn workload: exact text for a seed, lengths, sharing and validation."""

import subprocess
import sys

import pytest

from kvtier.entrypoints.bench.config import MultiTurnConfig, ServerTarget
from kvtier.entrypoints.bench.workload import (
    build_conversations,
    make_text,
    render_completion_prompt,
)

SMALL = MultiTurnConfig(num_conversations=2, num_turns=2, system_prompt_tokens=4,
                        context_tokens=3, user_tokens=2)


def test_seed_zero_gives_the_recorded_text():
    first, second = build_conversations(SMALL)
    assert first.system_prompt == "war history guy home\nConversation 0: power milk egg"
    assert first.user_messages == ("book thing", "field problem")
    assert second.system_prompt == "war history guy home\nConversation 1: game mountain area"
    assert second.user_messages == ("place quick", "hand brown")


def test_same_text_in_a_fresh_process_with_another_hash_seed():
    code = ("from kvtier.entrypoints.bench.config import MultiTurnConfig;"
            "from kvtier.entrypoints.bench.workload import build_conversations;"
            "c = build_conversations(MultiTurnConfig(num_conversations=2, num_turns=2,"
            " system_prompt_tokens=4, context_tokens=3, user_tokens=2));"
            "print(repr([(s.system_prompt, s.user_messages) for s in c]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "12345"}, timeout=60, check=True).stdout
    expected = [(s.system_prompt, s.user_messages) for s in build_conversations(SMALL)]
    assert out.strip() == repr(expected)


def test_lengths_follow_the_config():
    config = MultiTurnConfig(num_conversations=3, num_turns=5, system_prompt_tokens=50,
                             context_tokens=20, user_tokens=7)
    scripts = build_conversations(config)
    assert len(scripts) == 3
    for script in scripts:
        # shared prefix + "Conversation <i>:" + context
        assert len(script.system_prompt.split()) == 50 + 2 + 20
        assert [len(m.split()) for m in script.user_messages] == [7] * 5


def test_prefix_is_shared_and_contexts_differ():
    config = MultiTurnConfig(num_conversations=4, system_prompt_tokens=30, context_tokens=10)
    scripts = build_conversations(config)
    prefixes = {s.system_prompt.split("\n")[0] for s in scripts}
    contexts = {s.system_prompt.split("\n")[1] for s in scripts}
    assert len(prefixes) == 1
    assert len(contexts) == 4


def test_another_seed_changes_the_text():
    other = build_conversations(MultiTurnConfig(**{**SMALL.__dict__, "seed": 1}))
    assert other[0].system_prompt != build_conversations(SMALL)[0].system_prompt


def test_zero_length_text_is_empty():
    import random
    assert make_text(random.Random(0), 0) == ""


def test_completion_prompt_rendering():
    messages = [{"role": "system", "content": "a b"}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": " d"}, {"role": "user", "content": "e"}]
    assert render_completion_prompt(messages) == \
        "System: a b\nUser: c\nAssistant: d\nUser: e\nAssistant:"


@pytest.mark.parametrize("field, value", [("num_conversations", 0), ("num_turns", 0),
                                          ("system_prompt_tokens", -1), ("user_tokens", 0),
                                          ("output_tokens", 0), ("think_time_s", -0.5),
                                          ("start_interval_s", -1.0)])
def test_bad_workload_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"MultiTurnConfig.{field}"):
        MultiTurnConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("url", "127.0.0.1:8000"), ("api", "embeddings"),
                                          ("request_timeout_s", 0.0), ("run_timeout_s", -1.0)])
def test_bad_target_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"ServerTarget.{field}"):
        ServerTarget(**{field: value})
