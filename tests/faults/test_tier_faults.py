"""Shared-tier faults against a real server process: a read-only directory, a full disk, chunks
forged by someone who can write the directory, symlinks planted in it. Every answer equals an
undisturbed server's (greedy, fp32)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from ..entrypoints.server_process import ServerProcess
from ..offload.mounts import read_only_view, small_tmpfs
from ..offload.test_chunk_mac_e2e import _forge
from ..tiny_models import make_hf_model
from .test_restart_faults import STORE_DEADLINE_S, _answers, _metric, _wait_stored


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tier_fault_model"))
    make_hf_model("llama", directory, tokenizer="bytes")
    return directory


def _serve(model_dir: str, tier_dir: Path, host: str = "64MiB") -> ServerProcess:
    return ServerProcess(model_dir, "--kv-offload", f"host={host},fs={tier_dir}")


def _first_answers(model_dir: str, tier_dir: Path) -> list[str]:
    """The answers of a server that fills `tier_dir`, once its writes have ended."""
    server = _serve(model_dir, tier_dir)
    try:
        answers = _answers(server.url)
        _wait_stored(server.url, "fs")
    finally:
        server.stop()
    return answers


def _files(directory: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in directory.rglob("*.kvc")}


def _wait_skipped(url: str) -> float:
    """The read-only skips, once counted. A tier's outcomes are collected at engine steps and
    an idle engine takes none: a one-token request after each look gives it one."""
    deadline = time.monotonic() + STORE_DEADLINE_S
    while True:
        skipped = _metric(url, "kvtier:offload_tier_dropped_stores", tier="fs",
                          reason="read_only")
        if skipped > 0 or time.monotonic() > deadline:
            return skipped
        httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": "step", "max_tokens": 1}).raise_for_status()
        time.sleep(0.2)


def test_read_only_shared_directory_serves_hits_and_skips_stores(model_dir, tmp_path):
    expected = _first_answers(model_dir, tmp_path / "shared")
    before = _files(tmp_path / "shared")
    with read_only_view(tmp_path / "shared", tmp_path / "ro") as ro:
        server = _serve(model_dir, ro)
        try:
            assert _answers(server.url) == expected
            response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "prompt": "a prompt no server has seen " * 4, "max_tokens": 8})
            assert response.status_code == 200, response.text
            skipped = _wait_skipped(server.url)
            hits = _metric(server.url, "kvtier:offload_tier_hits", tier="fs")
            errors = _metric(server.url, "kvtier:offload_tier_errors", tier="fs")
        finally:
            server.stop()
    assert hits > 0 and errors == 0 and skipped > 0  # the new prompt's chunks
    assert _files(tmp_path / "shared") == before


def test_full_disk_evicts_and_keeps_storing(model_dir, tmp_path):
    expected = _first_answers(model_dir, tmp_path / "reference")
    with small_tmpfs(tmp_path / "small", "256k") as small:
        # 1 MiB of host memory: the chunks cannot stay in host memory either.
        server = _serve(model_dir, small, host="1MiB")
        try:
            assert _answers(server.url) == expected
            assert _answers(server.url) == expected
            evicted = _metric(server.url, "kvtier:offload_fs_evictions", tier="fs")
            written = _metric(server.url, "kvtier:offload_bytes", direction="host_to_fs")
        finally:
            server.stop()
    assert evicted > 0 and written > 256 * 1024  # it went on storing once the disk was full


def test_forged_chunks_are_refused_with_a_secret(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CHUNK_SECRET", os.urandom(16).hex())
    expected = _first_answers(model_dir, tmp_path / "shared")
    assert _forge(tmp_path / "shared", keep_mac=True) > 0
    server = _serve(model_dir, tmp_path / "shared")
    try:
        assert _answers(server.url) == expected
        errors = _metric(server.url, "kvtier:offload_tier_errors", tier="fs")
    finally:
        server.stop()
    assert errors > 0


def test_planted_symlinks_lead_nowhere(model_dir, tmp_path):
    expected = _first_answers(model_dir, tmp_path / "shared")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.kvc").write_bytes(b"precious")
    namespace_dir = next(p for p in (tmp_path / "shared").iterdir() if p.is_dir())
    for sub in list(namespace_dir.iterdir()):  # every chunk subdirectory becomes a symlink
        if sub.is_dir():
            for chunk in sub.iterdir():
                chunk.unlink()
            sub.rmdir()
            sub.symlink_to(outside)
    server = _serve(model_dir, tmp_path / "shared", host="1MiB")
    try:
        assert _answers(server.url) == expected
        assert _answers(server.url) == expected
    finally:
        server.stop()
    assert [p.name for p in outside.iterdir()] == ["victim.kvc"]
    assert (outside / "victim.kvc").read_bytes() == b"precious"
