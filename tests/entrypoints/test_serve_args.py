"""`kvtier serve` argument checks that fail before any model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.entrypoints.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HEAVY = ("torch", "fastapi", "uvicorn")
_TIER_TYPO = json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
    "cpu_bytes_to_use": "1GiB", "secondary_tiers": [{"type": "fs", "rootdir": "/tmp"}]}})


@pytest.mark.parametrize("value", ["0", "-0.001", "2"])
def test_switch_interval_out_of_range_is_a_one_line_error(value, capsys):
    assert main(["serve", "--switch-interval", value]) != 0
    err = capsys.readouterr().err.strip()
    assert err == ("kvtier serve: error: --switch-interval must be in (0, 1] seconds, "
                   f"got {float(value)}")


def run_serve(*args: str) -> tuple[int, list[str], set[str]]:
    """`kvtier serve ARGS` in a fresh interpreter: (exit code, stderr lines that are not
    import timings, top-level packages it imported)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvtier.entrypoints.cli", "serve", *args],
        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
    lines = result.stderr.splitlines()
    # `-X importtime` writes a header, then "import time: self | cumulative | module" for every
    # module imported.
    timings = [line for line in lines if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in timings
                if not line.endswith("imported package")}
    return result.returncode, [line for line in lines if line not in timings], imported


@pytest.mark.parametrize("args, message", [
    (["--kv-offload", "host=2XiB"],
     "--kv-offload host must be a byte size such as 4GiB, 512MiB or 1073741824, got '2XiB'"),
    (["--kv-offload", "host=1GiB,fs=/tmp,write=soon"],
     "--kv-offload write must be through or back, e.g. write=back, got 'soon'"),
    (["--kv-transfer-config", "{bad"],
     "--kv-transfer-config is not valid JSON (Expecting property name enclosed in double "
     "quotes: line 1 column 2 (char 1)): '{bad'; write it like {\"kv_connector\": "
     "\"OffloadingConnector\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": "
     "\"4GiB\"}}"),
    (["--kv-transfer-config", _TIER_TYPO],
     "kv_connector_extra_config.secondary_tiers[0]: unknown key 'rootdir'; valid keys are "
     "['admit_after_hits', 'max_bytes', 'max_pending_stores', 'module_path', 'name', "
     "'num_read_threads', 'num_write_threads', 'root_dir', 'type', 'write_nice', "
     "'write_policy']"),
    (["--kv-offload", "host=1GiB", "--kv-transfer-config", "{}"],
     "argument --kv-transfer-config: not allowed with argument --kv-offload"),
    (["--speculative-config", '{"method": "eagle"}'],
     "speculative_config.method must be one of ngram, got 'eagle'"),
    (["--chat-template", "no/such/template.jinja"],
     "--chat-template 'no/such/template.jinja': no such file; give the path of a file holding "
     "a Jinja chat template, or the template itself"),
])
def test_bad_offload_option_fails_in_one_line_before_any_heavy_import(args, message):
    code, errors, imported = run_serve(*args)
    assert code == 2
    assert errors == [f"kvtier serve: error: {message}"]
    assert "kvtier" in imported  # the import listing works: the check below can fail
    assert imported.isdisjoint(_HEAVY), imported & set(_HEAVY)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_shutdown_timeout_must_be_finite_and_positive(value, capsys):
    assert main(["serve", "/no/such/model", "--shutdown-timeout", value]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtier serve: error: --shutdown-timeout must be a finite number of seconds > 0, "
        f"got {float(value)}")


def test_switch_interval_nan_is_refused(capsys):
    assert main(["serve", "/no/such/model", "--switch-interval", "nan"]) == 2
    assert "--switch-interval must be in (0, 1] seconds, got nan" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--host", "256.1.1.1"], "--host '256.1.1.1' does not resolve to an address ("),
    (["--seed", str(2**70)], "--seed must be an integer in [-2**63, 2**64 - 1], got "
                             f"{2**70}"),
    (["--device", "nosuch"], "--device 'nosuch' is not a device PyTorch knows ("),
    (["--kv-events-config", '{"hwm": 1.5}'],
     "kv_events_config.hwm must be an integer in [1, 2147483647], got 1.5"),
    (["--responses-store-size", "lots"], "--responses-store-size must be a byte size such as "),
    # Else any client sending an empty key ("Authorization: Bearer ") would get in.
    (["--api-key", ""], "--api-key must not be empty; leave it out to serve without a key"),
])
def test_bad_server_values_fail_in_one_line_before_the_model_loads(args, message, capsys):
    # No such model: had the check come after loading, the error would name the model.
    assert main(["serve", "/no/such/model", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvtier serve: error: {message}"), err
    assert "\n" not in err


def test_a_taken_port_fails_before_the_model_loads(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "/no/such/model", "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvtier serve: error: cannot listen on --host 127.0.0.1 --port {port}: address already "
        "in use; give an address of this machine and a free port")


@pytest.mark.parametrize("args", [["--enable-auto-tool-choice"],
                                  ["--tool-call-parser", "hermes"]])
def test_auto_tool_choice_and_its_parser_go_together(args, capsys):
    assert main(["serve", "/no/such/model", *args]) == 2
    assert "--enable-auto-tool-choice and --tool-call-parser go together" in \
        capsys.readouterr().err
