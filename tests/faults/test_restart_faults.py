"""A server killed with SIGKILL, restarted on the same tier directory, with its tier data intact,
damaged, cut short or gone: every answer equals the first server's (greedy, fp32), intact data
is served from the tier, damaged data is a counted error and a recompute."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvtier.entrypoints.bench.metrics_scrape import parse_samples

from ..entrypoints.server_process import ServerProcess
from ..tiny_models import make_hf_model

# Byte tokenizer: a character a token, so each prompt fills about 17 blocks of 16 tokens.
PROMPTS = [f"conversation {i}: " + "the quick brown fox jumps over the lazy dog " * 6
           for i in range(3)]
STORE_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("restart_model"))
    # Room for a stream that outlasts a second (test_a_forced_quit_ends_cleanly_...).
    make_hf_model("llama", directory, tokenizer="bytes", max_position_embeddings=2048)
    return directory


def _serve(model_dir: str, tier: str, tier_dir: Path) -> ServerProcess:
    spec = f"disk={tier_dir}:64MiB" if tier == "disk" else f"fs={tier_dir}"
    return ServerProcess(model_dir, "--kv-offload", f"host=64MiB,{spec}")


def _answers(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def _metric(url: str, name: str, **labels: str) -> float:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and all(dict(sample_labels).get(k) == v
                                         for k, v in labels.items()))


def _wait_stored(url: str, tier: str) -> None:
    """Until the bytes written to the tier stop growing (write-through: every chunk goes)."""
    deadline, last = time.monotonic() + STORE_DEADLINE_S, -1.0
    while time.monotonic() < deadline:
        written = _metric(url, "kvtier:offload_bytes", direction=f"host_to_{tier}")
        if written > 0 and written == last:
            return
        last = written
        time.sleep(0.5)
    raise TimeoutError(f"no stable {tier} writes within {STORE_DEADLINE_S} s")


def _damage(tier_dir: Path, how: str) -> int:
    """Damage every data file under `tier_dir` (not the namespace descriptions); returns how
    many files were touched."""
    files = [p for p in tier_dir.rglob("*") if p.is_file() and p.suffix != ".json"]
    for path in files:
        size = path.stat().st_size
        if how == "delete":
            path.unlink()
        elif how == "truncate":
            os.truncate(path, size // 2)
        else:  # flip a byte in the middle of every 4 KiB page: payloads, not the headers
            with open(path, "r+b") as f:
                for offset in range(2048, size, 4096):
                    f.seek(offset)
                    byte = f.read(1)
                    f.seek(offset)
                    f.write(bytes([byte[0] ^ 0xFF]))
    return len(files)


@pytest.mark.parametrize("tier", ["disk", "fs"])
@pytest.mark.parametrize("damage", [None, "flip", "truncate", "delete"])
def test_sigkill_then_restart(model_dir, tmp_path, tier, damage):
    tier_dir = tmp_path / "tier"
    first = _serve(model_dir, tier, tier_dir)
    try:
        expected = _answers(first.url)
        _wait_stored(first.url, tier)
    finally:
        first.process.kill()  # SIGKILL: no flush, no clean close
        first.stop()
    if damage is not None:
        assert _damage(tier_dir, damage) > 0
    second = _serve(model_dir, tier, tier_dir)
    try:
        assert _answers(second.url) == expected
        hits = _metric(second.url, "kvtier:offload_tier_hits", tier=tier)
        errors = _metric(second.url, "kvtier:offload_tier_errors", tier=tier)
    finally:
        second.stop()
    if damage is None:
        assert hits > 0 and errors == 0
    elif damage == "flip":
        assert errors > 0


def test_a_restart_with_another_model_frees_the_old_models_disk_file(model_dir, tmp_path):
    """The disk tier's size is the directory's: the file of a model no server runs any more is
    removed at the next start-up, not kept beside the new one."""
    other_model = str(tmp_path / "other_model")
    make_hf_model("llama", other_model, tokenizer="bytes", seed=1)
    tier_dir = tmp_path / "tier"
    first = _serve(model_dir, "disk", tier_dir)
    try:
        _answers(first.url)
    finally:
        first.process.kill()  # SIGKILL: its lock ends with the process
        first.stop()
    [old_file] = tier_dir.glob("*.kvslots")
    second = _serve(other_model, "disk", tier_dir)
    try:
        _answers(second.url)
    finally:
        second.stop()
    [new_file] = tier_dir.glob("*.kvslots")
    assert new_file != old_file
    assert sorted(p.name for p in tier_dir.iterdir()) == [new_file.stem + ".json", new_file.name]


def test_a_forced_quit_ends_cleanly_and_keeps_write_back_chunks(model_dir, tmp_path):
    """A second Ctrl-C makes uvicorn skip the app's shutdown; the engine's own shutdown,
    which writes write-back chunks out, still runs, and the server exits with 130, no
    traceback. A stream kept open holds the first Ctrl-C's graceful wait, so the second one
    lands during it."""
    tier_dir = tmp_path / "tier"
    offload = f"host=64MiB,disk={tier_dir}:64MiB,write=back"
    first = ServerProcess(model_dir, "--kv-offload", offload)
    stream = httpx.stream("POST", f"{first.url}/v1/completions", timeout=120, json={
        "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
        "stream": True})
    try:
        with stream as response:
            next(response.iter_lines())  # its prompt is computed and offloaded to host memory
            first.process.send_signal(signal.SIGINT)
            time.sleep(1.0)
            first.process.send_signal(signal.SIGINT)
            assert first.process.wait(STORE_DEADLINE_S) == 130
    except httpx.HTTPError:
        pass  # the stream ends with the server
    finally:
        first.stop()
    assert "Traceback" not in first.log()
    second = ServerProcess(model_dir, "--kv-offload", offload)
    try:
        _answers(second.url)
        assert _metric(second.url, "kvtier:offload_tier_hits", tier="disk") > 0
    finally:
        second.stop()
