"""The redis tier against real Valkey servers when a request is refused, a value carries another
instance's MAC, a cluster stops answering, or the URL does not fit the server: a refusal fails
one job, another secret's value stays, every wait has a deadline, and a wrong URL is a one-line
error at start-up naming the fix."""

import itertools
import time

import pytest

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.redis_tier import RedisTier, RedisTierError, RedisTierOptions

from ..stores import ValkeyServer
from .offload_helpers import (
    NAMESPACE,
    chunk_bytes,
    key,
    settled_lookup,
    tier_factory,
    tier_job,
    tier_load,
    tier_store,
    wait_jobs,
)

_prefixes = itertools.count()
_PUT_ERRORS = 'kvtier:offload_store_request_errors_total{tier="redis",store="redis",op="put"}'


@pytest.fixture
def make_tier():
    yield from tier_factory(lambda url, secret=None, metrics=None, **options: RedisTier(
        RedisTierOptions(url=url, key_prefix=f"err{next(_prefixes)}", **options),
        TierContext("redis", NAMESPACE, metrics=metrics, chunk_secret=secret)))



def test_a_refused_write_fails_that_job_alone(make_tier, tmp_path):
    # noeviction: once the memory is full the server refuses every write with OOM.
    with ValkeyServer(tmp_path, extra_args=("--maxmemory-policy", "noeviction")) as server:
        metrics = MetricsRegistry()
        tier = make_tier(server.url, metrics=metrics)
        assert tier_store(tier, 1)
        _fill(server)
        assert not tier_store(tier, 2)
        assert metrics.snapshot()[_PUT_ERRORS] == 1
        assert tier.lookup(key(1)) is LookupResult.FOUND  # the store is not marked down
        assert tier_load(tier, 1) == (True, chunk_bytes(1))


def _fill(server):
    """Set maxmemory below what the server uses: under noeviction it refuses every write."""
    client = server.client()
    client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)


def test_a_value_with_another_secrets_mac_is_a_miss_and_stays(make_tier, single):
    writer = make_tier(single.url, secret=b"A" * 32)
    assert tier_store(writer, 1)
    reader = make_tier(single.url, secret=b"B" * 32)
    reader._prefix = writer._prefix  # the same pool
    assert settled_lookup(reader, 1) is LookupResult.FOUND
    assert not tier_load(reader, 1)[0]
    assert reader.lookup(key(1)) is LookupResult.NOT_FOUND
    assert single.client().exists(writer._name(key(1))) == 1
    assert tier_load(writer, 1) == (True, chunk_bytes(1))


def test_a_paused_cluster_answers_each_check_within_its_deadline(make_tier, cluster):
    # Before: the cluster client retried the timeout and refreshed its slot map node by node,
    # five timeouts per check.
    tier = make_tier(cluster.url, connect_timeout_s=0.5, timeout_s=1.0)
    assert tier_store(tier, 1)
    cluster.pause()
    try:
        for n in (2, 3):
            start = time.monotonic()
            assert settled_lookup(tier, n) is LookupResult.NOT_FOUND
            assert time.monotonic() - start < 4.0  # the deadline: 0.5 + 1.0 + 1.0 s
            time.sleep(1.1)  # the "down" mark lapses: the next check asks again
        job = tier_job(1, memoryview(bytearray(len(chunk_bytes(1)))))
        start = time.monotonic()
        tier.submit_load(job)
        assert wait_jobs(tier, [job.job_id]) == {job.job_id: False}
    finally:
        cluster.resume()


def test_a_cluster_node_named_as_one_server_is_an_error_at_start_up(cluster):
    node = cluster.nodes[0]
    with pytest.raises(RedisTierError, match="is a node of a cluster; name it as "
                                             "redis\\+cluster://") as e:
        RedisTier(RedisTierOptions(url=node.url), TierContext("redis", NAMESPACE))
    assert "\n" not in str(e.value)


def test_a_single_server_named_as_a_cluster_is_an_error_at_start_up(single):
    with pytest.raises(RedisTierError, match="is not a cluster node; name a single server as "
                                             "redis://"):
        RedisTier(RedisTierOptions(url=f"redis+cluster://127.0.0.1:{single.port}"),
                  TierContext("redis", NAMESPACE))


def test_a_database_the_server_lacks_is_an_error_at_start_up(single):
    url = f"redis://127.0.0.1:{single.port}/99"
    with pytest.raises(RedisTierError, match="has no database 99 .*`databases` setting") as e:
        RedisTier(RedisTierOptions(url=url), TierContext("redis", NAMESPACE))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("url, message", [
    ("redis://h:99999/0", "port must be a number in 1..65535"),
    ("redis://h:abc/0", "port must be a number in 1..65535"),
    ("redis://h:6379/0?timeout_s=1", "must not carry options after '\\?'"),
    ("redis+cluster://h:7000/5", "of a cluster names no database"),
])
def test_url_parts_the_tier_would_not_honour_are_refused(url, message):
    with pytest.raises(ValueError, match=f"^redis.url {message}"):
        RedisTierOptions(url=url)
