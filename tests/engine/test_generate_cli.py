"""`kvtier generate`: end to end in a subprocess on the packaged default model; argument
handling in-process (a fresh interpreter per case would only re-import torch)."""

import os
import subprocess
import sys

import pytest

from kvtier.entrypoints.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_model_knows_the_capital_of_france():
    # One intra-op thread: on a shared 2-core machine a second one only spins against others.
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.entrypoints.cli", "generate", "The capital of France is"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_help_lists_the_engine_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--kv-cache-memory-bytes", "--no-enable-prefix-caching", "--kv-offload",
                   "--max-num-batched-tokens", "--kv-transfer-config", "--num-device-blocks"):
        assert option in out


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--block-size", "0"], "block_size must be >= 1, got 0"),
    (["generate", "hi", "--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["generate", "hi", "--kv-transfer-config", "{nope"], "not valid JSON"),
    (["generate", "hi", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate"], "PROMPT"),
    (["nonsense"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, args, message):
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_a_model_directory_without_config_is_named(capsys, tmp_path):
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(tmp_path) in err and "config.json" in err and "\n" not in err
