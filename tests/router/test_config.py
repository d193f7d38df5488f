"""`kvtier router` flags checked once at the edge: a bad one is a one-line error naming it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvtier.router.cli import add_arguments, config_from_args

INSTANCE = ["--instance", "http://127.0.0.1:9"]
PD = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"]


def _config(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.mark.parametrize("argv, message", [
    # Once the router started and logged an ExceptionGroup at every health check.
    (["--instance", "http://127.0.0.1:99999"],
     "--instance 'http://127.0.0.1:99999' is not a valid URL (Port out of range"),
    (["--instance", "http://[::1"], "--instance 'http://[::1' is not a valid URL (Invalid IPv6"),
    (["--instance", "http://127.0.0.1:0"], "--instance 'http://127.0.0.1:0': port 0"),
    (["--prefill", "http://a:1", "--decode", "http://b:123456"], "--decode 'http://b:123456'"),
    # A NaN passed `<= 0`: a NaN health interval checked ~9 times a second.
    ([*INSTANCE, "--health-interval", "nan"], "--health-interval must be a finite number"),
    ([*INSTANCE, "--health-interval", "0"], "--health-interval must be a finite number"),
    ([*INSTANCE, "--read-timeout", "inf"], "--read-timeout must be a finite number"),
    ([*INSTANCE, "--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite number"),
    ([*PD, "--prefill-timeout", "nan"], "--prefill-timeout must be a finite number"),
    # P/D-only flags are refused in instance mode, not ignored.
    ([*INSTANCE, "--prefill-timeout", "5"], "--prefill-timeout is for P/D mode"),
    ([*INSTANCE, "--local-prefill-tokens", "5"], "--local-prefill-tokens is for P/D mode"),
    # An empty key sent no key at all, as if the flag were left out.
    ([*INSTANCE, "--instance-api-key", ""], "--instance-api-key must not be empty"),
])
def test_bad_flags_name_themselves(argv, message):
    with pytest.raises(ValueError) as error:
        _config(argv)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_pd_flags_pass_in_pd_mode():
    config = _config([*PD, "--prefill-timeout", "5", "--local-prefill-tokens", "64"])
    assert (config.prefill_timeout_s, config.local_prefill_tokens) == (5.0, 64)


def test_the_router_imports_no_torch():
    """The router loads a tokenizer, never a model: it runs where torch is not installed."""
    script = "import sys, kvtier.router.app; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "False"
