"""The obj tier against a small local S3 server that answers with the errors SeaweedFS cannot be
made to give (a refused PUT, a HEAD answered 403 or 500, a trickling GET, a failed or partial
DeleteObjects, a HeadBucket answered 5xx or 301): a refusal fails one job, every wait has a
deadline, nothing written is lost from the budget, and a wrong setting is a one-line error."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.tiers.base import LookupResult, TierContext, TransferJob
from kvtier.offload.tiers.obj import ObjTier, ObjTierError, ObjTierOptions

from .offload_helpers import (
    CHUNK,
    NAMESPACE,
    key,
    settled_lookup,
    tier_factory,
    tier_store,
    wait_jobs,
)

_ERRORS = 'kvtier:offload_store_request_errors_total{{tier="obj",store="s3",op="{}"}}'
_GOOD_DELETE = b"<DeleteResult></DeleteResult>"


class _Handler(BaseHTTPRequestHandler):
    """Answers as `server.answers` says: {"put": status, "head": {name: status} (others 404),
    "head_bucket": status, "get": "trickle", "delete": status or a DeleteResult body}."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self, status, body=b"", headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status):
        self._reply(status, f"<Error><Code>{status}</Code><Message>m</Message></Error>".encode())

    def do_HEAD(self):
        name = self.path.split("?")[0].strip("/").partition("/")[2]
        if not name:
            status = self.server.answers.get("head_bucket", 200)
            region = [("x-amz-bucket-region", "eu-west-1")] if status == 301 else []
            return self._reply(status, headers=region)
        self._reply(self.server.answers.get("head", {}).get(name, 404))

    def do_PUT(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status = self.server.answers.get("put", 200)
        self._reply(200, headers=[("ETag", '"e"')]) if status == 200 else self._error(status)

    def do_POST(self):  # DeleteObjects
        self.server.deletes.append(self.rfile.read(int(self.headers["Content-Length"])))
        answer = self.server.answers.get("delete", _GOOD_DELETE)
        self._reply(200, answer) if isinstance(answer, bytes) else self._error(answer)

    def do_GET(self):  # a trickle: a byte every 0.05 s, each well within the read timeout
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(100000):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            return


@pytest.fixture
def s3(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.answers, server.deletes = {}, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
    for name, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def make_tier(s3):
    yield from tier_factory(lambda metrics=None, **options: ObjTier(
        ObjTierOptions(bucket="b", prefix="p", connect_timeout_s=0.5, timeout_s=0.5, **options),
        TierContext("obj", NAMESPACE, metrics=metrics, max_chunk_bytes=CHUNK)))



def test_a_refused_put_fails_that_job_alone(make_tier, s3):
    metrics = MetricsRegistry()
    tier = make_tier(metrics)
    assert tier_store(tier, 1)
    s3.answers["put"] = 403
    assert not tier_store(tier, 2)
    assert metrics.snapshot()[_ERRORS.format("put")] == 1
    assert tier.lookup(key(1)) is LookupResult.FOUND  # the store is not marked down


def test_a_head_answered_403_counts_and_misses_that_key_alone(make_tier, s3):
    metrics = MetricsRegistry()
    tier = make_tier(metrics)
    s3.answers["head"] = {tier._name(key(1)): 403, tier._name(key(2)): 200}
    assert tier.lookup(key(1)) is tier.lookup(key(2)) is LookupResult.UNKNOWN  # one batch
    assert settled_lookup(tier, 1) is LookupResult.NOT_FOUND
    assert settled_lookup(tier, 2) is LookupResult.FOUND
    assert metrics.snapshot()[_ERRORS.format("exists")] == 1


def test_a_head_answered_500_counts_and_marks_the_store_down(make_tier, s3):
    metrics = MetricsRegistry()
    tier = make_tier(metrics)
    assert tier_store(tier, 1)
    s3.answers["head"] = {tier._name(key(2)): 500}
    assert settled_lookup(tier, 2) is LookupResult.NOT_FOUND
    assert metrics.snapshot()[_ERRORS.format("exists")] == 1
    assert tier.lookup(key(1)) is LookupResult.NOT_FOUND  # down for a second


def test_a_trickling_get_fails_at_the_jobs_deadline(make_tier):
    tier = make_tier()
    job = TransferJob(1, key(1), memoryview(bytearray(CHUNK)), time.monotonic() + 1.0)
    tier.submit_load(job)
    assert wait_jobs(tier, [job.job_id], timeout=5.0) == {job.job_id: False}


def test_no_bookkeeping_without_a_budget(make_tier):
    tier = make_tier()
    for n in range(5):
        assert tier_store(tier, n)
    assert len(tier._written) == 0


@pytest.mark.parametrize("answer", [403, b"<DeleteResult><Error><Key>{}</Key><Code>AccessDenied"
                                          b"</Code><Message>m</Message></Error></DeleteResult>"])
def test_objects_the_store_did_not_delete_stay_in_the_budget(make_tier, s3, answer):
    tier = make_tier(max_bytes=2 * 200)  # two objects of a 64-byte chunk and its header
    assert tier_store(tier, 1) and tier_store(tier, 2)
    first = tier._name(key(1))
    s3.answers["delete"] = answer.replace(b"{}", first.encode()) if answer != 403 else 403
    assert tier_store(tier, 3)  # its eviction failed, the PUT did not
    s3.answers["delete"] = _GOOD_DELETE
    assert tier_store(tier, 4)
    assert first.encode() in s3.deletes[0] and first.encode() in s3.deletes[1]


@pytest.mark.parametrize("status", [500, 503])
def test_a_bucket_check_answered_5xx_starts_the_tier_down(make_tier, s3, status):
    s3.answers["head_bucket"] = status
    tier = make_tier()
    assert settled_lookup(tier, 1) is LookupResult.NOT_FOUND


@pytest.mark.parametrize("status, message", [
    (301, "bucket 'b' is in region eu-west-1; set obj.region"),
    (400, "refused the request for bucket 'b' \\(400\\); check obj.bucket"),
])
def test_a_bucket_check_refused_is_a_one_line_error(make_tier, s3, status, message):
    s3.answers["head_bucket"] = status
    with pytest.raises(ObjTierError, match=f"^obj tier: .*{message}") as e:
        make_tier()
    assert "\n" not in str(e.value)


def test_a_budget_below_one_chunk_is_refused():
    with pytest.raises(ObjTierError, match="max_bytes=32 holds no chunk"):
        ObjTier(ObjTierOptions(bucket="b", max_bytes=32),
                TierContext("obj", NAMESPACE, max_chunk_bytes=CHUNK))


def test_an_invalid_bucket_name_is_refused():
    with pytest.raises(ValueError, match="^obj.bucket must be a bucket name"):
        ObjTierOptions(bucket="Bad_Bucket!")
