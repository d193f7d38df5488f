"""The obj tier against a real S3-compatible store (SeaweedFS on 127.0.0.1): chunks round-trip
in the checked format, lookups never block, a second engine gets hits for what the first served,
and a dead, paused or corrupted store costs errors and misses, never wrong tokens."""

import itertools
import time

import pytest

from kvtier.offload.chunk_format import HEADER_BYTES, MAC_BYTES
from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.obj import ObjTier, ObjTierError, ObjTierOptions

from ..stores import SeaweedS3
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

BUCKET = "kv-cache"
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs")) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def aws_env(s3, monkeypatch):
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3


@pytest.fixture
def prefix():
    return f"test{next(_prefixes)}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return e2e.make_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def make_tier(aws_env, prefix):
    yield from tier_factory(lambda **options: ObjTier(
        ObjTierOptions(bucket=BUCKET, prefix=prefix, **options),
        TierContext("obj", NAMESPACE, description={"model": "m"})))



def test_store_then_load_round_trip_in_the_checked_format(make_tier, s3, prefix):
    tier = make_tier()
    assert tier.lookup(key(1)) is LookupResult.UNKNOWN  # never waits on the network
    assert settled_lookup(tier, 1) is LookupResult.NOT_FOUND
    assert tier_store(tier, 1)
    assert tier.lookup(key(1)) is LookupResult.FOUND
    assert tier_load(tier, 1) == (True, chunk_bytes(1))
    names = sorted(o["Key"] for o in s3.client().list_objects_v2(
        Bucket=BUCKET, Prefix=prefix)["Contents"])
    directory = f"{prefix}/{NAMESPACE.hex()}"
    assert names == sorted([f"{directory}/{NAMESPACE.hex()}.json", tier._name(key(1))])
    body = s3.client().get_object(Bucket=BUCKET, Key=tier._name(key(1)))["Body"].read()
    assert body.startswith(b"KVTC") and body.endswith(chunk_bytes(1))


def test_another_instance_finds_the_chunk_by_an_existence_check(make_tier):
    assert tier_store(make_tier(), 2)
    other = make_tier()
    assert other.lookup(key(2)) is LookupResult.UNKNOWN
    assert settled_lookup(other, 2) is LookupResult.FOUND
    assert tier_load(other, 2) == (True, chunk_bytes(2))


def test_max_bytes_deletes_this_instances_oldest_objects(make_tier, s3):
    tier = make_tier(max_bytes=3 * 200)  # three chunk objects of 64 payload bytes + header
    for n in range(1, 5):
        assert tier_store(tier, n)
    present = [n for n in range(1, 5) if _head(s3, tier._name(key(n)))]
    assert present == [2, 3, 4] or present == [3, 4]
    assert tier.lookup(key(1)) is not LookupResult.FOUND
    assert tier_load(tier, 4) == (True, chunk_bytes(4))


def test_a_corrupt_object_fails_its_load_and_is_deleted(make_tier, s3):
    tier = make_tier()
    assert tier_store(tier, 3)
    s3.client().put_object(Bucket=BUCKET, Key=tier._name(key(3)), Body=b"garbage" * 20)
    ok, _ = tier_load(tier, 3)
    assert not ok
    assert not _head(s3, tier._name(key(3)))
    assert tier.lookup(key(3)) is not LookupResult.FOUND


def test_an_oversized_object_is_read_no_further_than_the_longest_chunk(make_tier, s3,
                                                                      monkeypatch):
    tier = make_tier()
    assert tier_store(tier, 3)
    name = tier._name(key(3))
    chunk = s3.client().get_object(Bucket=BUCKET, Key=name)["Body"].read()
    s3.client().put_object(Bucket=BUCKET, Key=name, Body=chunk + bytes(1 << 20))
    num_read = spy_value_reads(tier, monkeypatch)
    assert not tier_load(tier, 3)[0]
    # One byte past the longest value of the chunk (with a MAC): its check fails there.
    assert num_read == [HEADER_BYTES + len(key(3)) + MAC_BYTES + CHUNK + 1]
    assert not _head(s3, name)  # deleted as a damaged one is


def test_a_missing_bucket_is_a_one_line_error_at_start_up(aws_env):
    with pytest.raises(ObjTierError, match="bucket 'no-such-bucket' does not exist at http") as e:
        ObjTier(ObjTierOptions(bucket="no-such-bucket"), TierContext("obj", NAMESPACE))
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


def test_wrong_credentials_are_a_one_line_error_at_start_up(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ObjTierError, match="refused the credentials for bucket 'kv-cache'") as e:
        ObjTier(ObjTierOptions(bucket=BUCKET), TierContext("obj", NAMESPACE))
    assert "\n" not in str(e.value) and "AWS_SECRET_ACCESS_KEY" in str(e.value)


def test_a_paused_store_costs_misses_within_the_timeouts(make_tier, s3):
    tier = make_tier(connect_timeout_s=0.5, timeout_s=0.5)
    assert tier_store(tier, 5)
    s3.pause()
    try:
        start = time.monotonic()
        assert settled_lookup(tier, 6) is LookupResult.NOT_FOUND
        job = tier_job(6)
        tier.submit_store(job)
        assert wait_jobs(tier, [job.job_id]) == {job.job_id: False}
        assert tier.lookup(key(5)) is LookupResult.NOT_FOUND  # down: known chunks miss too
        assert time.monotonic() - start < 5
    finally:
        s3.resume()
    time.sleep(1.2)
    assert tier.lookup(key(5)) is LookupResult.FOUND
    assert tier_load(tier, 5) == (True, chunk_bytes(5))


def _head(s3, name):
    try:
        s3.client().head_object(Bucket=BUCKET, Key=name)
    except Exception:
        return False
    return True


def _obj_tier(prefix, **options):
    return {"type": "obj", "bucket": BUCKET, "prefix": prefix, **options}


def test_a_second_engine_gets_hits_for_what_the_first_served(model, aws_env, prefix):
    e2e.second_instance_gets_hits(model, f"obj=s3://{BUCKET}/{prefix}", _obj_tier(prefix),
                                  "obj")


@pytest.mark.slow
def test_corrupt_objects_are_recomputed(model, aws_env, prefix, s3):
    def corrupt():
        client = s3.client()
        names = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)[
            "Contents"] if o["Key"].endswith(".kvc")]
        for name in names:
            client.put_object(Bucket=BUCKET, Key=name, Body=b"\x00garbage")
        return names

    e2e.corrupt_values_recompute(model, _obj_tier(prefix), "obj", corrupt)


@pytest.mark.slow
def test_store_killed_mid_run_then_restarted(model, aws_env, prefix, s3):
    e2e.store_down_then_back(model, _obj_tier(prefix, connect_timeout_s=0.5, timeout_s=1.0),
                             "obj", s3.kill, s3.start)


@pytest.mark.slow
def test_paused_store_costs_misses_not_a_hang(model, aws_env, prefix, s3):
    e2e.paused_store_misses(model, _obj_tier(prefix, connect_timeout_s=0.5, timeout_s=0.5),
                            "obj", s3)


def test_an_engine_on_a_missing_bucket_fails_at_start_up_with_one_line(model, aws_env):
    from kvtier import LLM

    with pytest.raises(ObjTierError, match="bucket 'no-such-bucket' does not exist") as e:
        LLM(model[0], dtype="float32", block_size=4, num_device_blocks=24,
            kv_offload="host=1MiB,obj=s3://no-such-bucket/p")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag, tier", [
    ("obj=s3://kv-cache", {"type": "obj", "bucket": "kv-cache"}),
    ("obj=s3://kv-cache/a/b:2GiB", {"type": "obj", "bucket": "kv-cache", "prefix": "a/b",
                                    "max_bytes": 2 * 2**30}),
])
def test_the_obj_flag_form(flag, tier):
    from kvtier.offload.config import parse_kv_offload

    assert parse_kv_offload(f"host=1GiB,{flag}")["secondary_tiers"] == [tier]


@pytest.mark.parametrize("flag", ["obj=kv-cache/p", "obj=s3:///p"])
def test_a_bad_obj_flag_names_the_form(flag):
    from kvtier.offload.config import parse_kv_offload

    with pytest.raises(ValueError, match=r"expected s3://BUCKET/PREFIX\[:SIZE\]"):
        parse_kv_offload(f"host=1GiB,{flag}")


def test_a_store_down_at_start_up_is_a_miss(aws_env, monkeypatch, prefix):
    from ..stores import free_ports

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    tier = ObjTier(ObjTierOptions(bucket=BUCKET, prefix=prefix, connect_timeout_s=0.5),
                   TierContext("obj", NAMESPACE))
    try:
        assert settled_lookup(tier, 7) is LookupResult.NOT_FOUND
        assert not tier_store(tier, 7)
    finally:
        tier.shutdown()
