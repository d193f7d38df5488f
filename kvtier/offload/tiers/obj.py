"""The obj tier: one object per chunk in a bucket of any S3-compatible store (AWS S3, SeaweedFS,
MinIO, Ceph RGW, ...), shared by every instance, on any machine, that uses the bucket.

Objects are named `<prefix>/<namespace hex>/<sha256(key)>.kvc` and hold the checked chunk
format, so instances with the same KV identity share them and others never see each other's;
`<prefix>/<namespace hex>/<namespace hex>.json` says what the namespace covers (for operators).
Chunks are small, so each is one plain PUT/GET (no multipart) on the tier's thread pools.

Lookups never block (see tiers/remote.py): a key this instance has not written or seen is checked
with HEAD requests on a thread pool, and the next lookup answers from that check. HEAD per key
rather than a listing: its cost follows the prompt, not the size of the bucket.

Capacity: `max_bytes` bounds what this instance wrote (its least recently used objects are
deleted; a restart forgets them; without it nothing is tracked); a shared bucket's total is
best bounded by a lifecycle rule that expires objects under the prefix (see docs/tiers.md). An
object the store would not delete stays counted, and is tried again at the next eviction.

A GET's body is read in the pieces the server sends, until the job's deadline: a server that
trickles bytes (each within the read timeout) cannot hold a read thread and its host slot. It is
read no further than one byte past the longest valid chunk (tiers/remote.py): the rest of a
larger object is never read into memory.

Credentials, region and endpoint come from the standard AWS configuration (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, AWS_PROFILE, ~/.aws/...) unless
the options name them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, ClassVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, ParamValidationError
from botocore.handlers import validate_bucket_name

from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.common.options import require
from kvtier.common.sizes import parse_size
from kvtier.offload.chunk_format import FORMAT_NAME
from kvtier.offload.keys import ChunkKey, key_digest
from kvtier.offload.tiers.base import TierContext
from kvtier.offload.tiers.remote import MissingChunk, RemoteTier, check_remote_options

logger = logging.getLogger(__name__)

# After an eviction pass this instance's objects are brought down to this share of max_bytes.
_EVICT_TO = 0.9
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_DENIED_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                 "InvalidClientTokenId", "InvalidToken", "ExpiredToken"}
# Most bytes one read of a GET's body asks for (it returns what has arrived, up to this).
_READ_PIECE = 1 << 20


class ObjTierError(ValueError):
    """The obj tier's bucket, region, budget or credentials are wrong (raised at start-up)."""


class DeleteRefused(Exception):
    """A DeleteObjects request the store answered with per-object errors; args[0]: the names
    it did not delete."""


@dataclass(frozen=True)
class ObjTierOptions:
    bucket: str
    # Objects go under `<prefix>/<namespace hex>/`; "" puts the namespaces at the top.
    prefix: str = "kvtier"
    # None: the AWS configuration's (AWS_ENDPOINT_URL, a profile's endpoint_url, or AWS S3).
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    # Byte budget for the objects this instance wrote; None: no limit (use lifecycle rules).
    max_bytes: int | str | None = None
    connect_timeout_s: float = 2.0
    # Read timeout of one request (a GET or PUT of one chunk).
    timeout_s: float = 5.0
    # Loads and existence checks each run on this many threads.
    num_read_threads: int = 8
    num_write_threads: int = 4
    write_nice: int = 10
    # Chunks the lookup index remembers (present, and recently found absent).
    max_index_entries: int = 1_000_000
    # Existence checks queued at once; beyond this a lookup of an unknown key is a miss.
    max_pending_checks: int = 4096

    def __post_init__(self) -> None:
        require(isinstance(self.bucket, str) and self.bucket != "", "obj.bucket",
                "must be a bucket name", self.bucket)
        try:
            validate_bucket_name({"Bucket": self.bucket})
        except ParamValidationError:
            raise ValueError(f"obj.bucket must be a bucket name (letters, digits, '.', '-', "
                             f"'_'; at most 255) or an access point ARN, got {self.bucket!r}"
                             ) from None
        require(isinstance(self.prefix, str), "obj.prefix", "must be a string", self.prefix)
        object.__setattr__(self, "prefix", self.prefix.strip("/"))
        if self.max_bytes is not None:
            object.__setattr__(self, "max_bytes", parse_size(self.max_bytes, "obj.max_bytes"))
            require(self.max_bytes > 0, "obj.max_bytes", "must be > 0", self.max_bytes)
        check_remote_options(self, "obj")


class ObjTier(RemoteTier):
    options_cls: ClassVar[type] = ObjTierOptions

    def __init__(self, options: ObjTierOptions, context: TierContext) -> None:
        chunk = context.max_chunk_bytes
        if options.max_bytes is not None and chunk is not None and options.max_bytes < chunk:
            raise ObjTierError(f"obj tier: max_bytes={options.max_bytes} holds no chunk; it must "
                               f"be at least one chunk ({chunk} bytes), e.g. "
                               f"obj=s3://BUCKET/PREFIX:100GiB")
        self._client = _make_client(options)
        self.endpoint = self._client.meta.endpoint_url
        self.directory = "/".join(filter(None, (options.prefix, context.namespace.hex())))
        _check_bucket(self._client, options.bucket, self.endpoint)
        super().__init__(options, context, store_kind="s3")
        self._heads = DaemonThreadPool(options.num_read_threads, f"kvtier-{context.name}-head")
        self._described = False
        # This instance's objects, least recently used first: name -> (key, bytes), for
        # max_bytes.
        self._written: OrderedDict[str, tuple[ChunkKey, int]] = OrderedDict()
        self._written_bytes = 0
        self._budget_lock = threading.Lock()

    def _name(self, key: ChunkKey) -> str:
        return f"{self.directory}/{key_digest(key)}.kvc"

    def _put(self, key: ChunkKey, data: bytes) -> None:
        if not self._described and self.context.description is not None:
            description = {**self.context.description, "format": FORMAT_NAME}
            self._client.put_object(Bucket=self.options.bucket,
                                    Key=f"{self.directory}/{self.context.namespace.hex()}.json",
                                    Body=json.dumps(description, indent=2).encode())
            self._described = True  # racing write threads both write the same object
        name = self._name(key)
        self._client.put_object(Bucket=self.options.bucket, Key=name, Body=data)
        self._account(key, name, len(data))

    def _get_within(self, name: str, deadline: float, max_bytes: int) -> bytes:
        try:
            response = self._client.get_object(Bucket=self.options.bucket, Key=name)
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                raise MissingChunk(name) from None
            raise
        with self._budget_lock:
            if name in self._written:
                self._written.move_to_end(name)
        with response["Body"] as body:  # urllib3's response, closed (mid-body too) on the way out
            return _read_by(body, deadline, max_bytes)

    def _delete(self, names: Sequence[str]) -> None:
        refused: list[str] = []
        for start in range(0, len(names), 1000):  # DeleteObjects takes up to 1000 keys
            response = self._client.delete_objects(Bucket=self.options.bucket, Delete={
                "Objects": [{"Key": name} for name in names[start:start + 1000]],
                "Quiet": True})
            refused += [error["Key"] for error in response.get("Errors", [])]
        if refused:
            raise DeleteRefused(refused)

    def _exists_many(self, names: Sequence[str]) -> list[bool]:
        """One HEAD per name, in parallel. An answer other than 404 counts as an error and as
        "absent" for its key alone (a 403 is what a key without s3:ListBucket gets for a missing
        object); an outage fails the batch, which marks the store down."""
        futures = [self._heads.submit(self._exists, name) for name in names]
        wait_s = self.options.connect_timeout_s + self.options.timeout_s + 1.0
        if wait(futures, timeout=wait_s).not_done:  # they end by themselves, within the timeouts
            raise TimeoutError(f"existence checks unanswered after {wait_s:g} s")
        answers = []
        for future in futures:
            error = future.exception()
            if error is not None and self._is_outage(error):
                raise error
            if error is not None:
                self._count_error("exists")
            answers.append(error is None and future.result())
        return answers

    def _exists(self, name: str) -> bool:
        try:
            self._client.head_object(Bucket=self.options.bucket, Key=name)
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                return False
            raise
        return True

    def _is_outage(self, exc: Exception) -> bool:
        if isinstance(exc, ClientError):
            return _status(exc) >= 500
        # botocore's connection errors and timeouts, and _read_by's deadline.
        return isinstance(exc, (BotoCoreError, OSError))

    def _account(self, key: ChunkKey, name: str, size: int) -> None:
        """Count the object just written against max_bytes, and evict down to _EVICT_TO of it
        when over. Nothing is tracked without a budget."""
        budget = self.options.max_bytes
        if budget is None:
            return
        with self._budget_lock:
            if name in self._written:
                self._written_bytes -= self._written[name][1]
            self._written[name] = (key, size)
            self._written.move_to_end(name)
            self._written_bytes += size
            victims: list[tuple[str, ChunkKey, int]] = []
            over = self._written_bytes > budget
            while over and self._written_bytes > budget * _EVICT_TO:
                victim = next(iter(self._written))
                if victim == name:
                    break  # never the object just written: its PUT succeeded
                victim_key, victim_size = self._written.pop(victim)
                self._written_bytes -= victim_size
                victims.append((victim, victim_key, victim_size))
        if victims:
            self._evict(victims)

    def _evict(self, victims: list[tuple[str, ChunkKey, int]]) -> None:
        """Delete the (name, key, size) `victims`, already out of the budget. Those the store
        did not delete are counted again, oldest first, so the next pass tries them first; a
        failure (counted by _call) fails no job: the PUT that caused it succeeded."""
        names = [name for name, _, _ in victims]
        try:
            self._call("delete", self._delete, names)
            kept: set[str] = set()
        except DeleteRefused as refused:
            kept = set(refused.args[0])
        except Exception:
            kept = set(names)
        with self._lock:
            for name, victim_key, _ in victims:
                if name not in kept:
                    self._known.pop(victim_key, None)
        with self._budget_lock:
            for name, victim_key, size in reversed(victims):
                if name in kept and name not in self._written:
                    self._written[name] = (victim_key, size)
                    self._written.move_to_end(name, last=False)
                    self._written_bytes += size

    def shutdown(self) -> bool:
        stopped = super().shutdown()
        return self._heads.shutdown(0.5, cancel_pending=True) and stopped


def _make_client(options: ObjTierOptions) -> Any:
    config = Config(connect_timeout=options.connect_timeout_s, read_timeout=options.timeout_s,
                    # No retries: the tier's own deadline and down-marking decide, a retry
                    # would only stretch a call past the job's deadline.
                    retries={"total_max_attempts": 1},
                    max_pool_connections=2 * options.num_read_threads + options.num_write_threads)
    try:
        session = boto3.session.Session(profile_name=options.profile,
                                        region_name=options.region)
    except BotoCoreError as exc:
        raise ObjTierError(f"obj tier: {exc}; fix obj.profile or AWS_PROFILE") from None
    return session.client("s3", endpoint_url=options.endpoint_url, config=config)


def _check_bucket(client: Any, bucket: str, endpoint: str) -> None:
    """Raise ObjTierError for a request the store refuses (a missing bucket, refused
    credentials, another region); a store that does not answer, or answers with a server
    error, only logs (the tier starts down and misses until the store answers)."""
    start = time.monotonic()
    try:
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise ObjTierError(f"obj tier: no AWS credentials for bucket {bucket!r} at {endpoint}; "
                           f"set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
                           ) from None
    except ClientError as exc:
        if _status(exc) < 500:
            raise ObjTierError(f"obj tier: {_refusal(exc, bucket, endpoint)}") from None
        logger.warning("obj tier: %s answered %s for bucket %r; the tier misses until the store "
                       "answers", endpoint, _code(exc), bucket)
    except BotoCoreError as exc:
        logger.warning("obj tier: cannot reach %s after %.1f s (%s); the tier misses until the "
                       "store answers", endpoint, time.monotonic() - start, exc)


def _refusal(exc: ClientError, bucket: str, endpoint: str) -> str:
    """What to fix when the store answered HeadBucket with a 3xx or 4xx `exc`."""
    code = _code(exc)
    if code in {"404", "NoSuchBucket", "NotFound"}:
        return (f"bucket {bucket!r} does not exist at {endpoint}; create it (aws s3 mb "
                f"s3://{bucket} --endpoint-url {endpoint}) or name an existing one")
    if code in _DENIED_CODES:
        return (f"{endpoint} refused the credentials for bucket {bucket!r} ({code}); set "
                f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to a key that "
                f"may read and write it")
    region = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get(
        "x-amz-bucket-region")
    if _status(exc) in (301, 307, 400) and region:
        return (f"bucket {bucket!r} is in region {region}; set obj.region (or "
                f"AWS_DEFAULT_REGION) to {region}")
    return (f"{endpoint} refused the request for bucket {bucket!r} ({code or _status(exc)}); "
            f"check obj.bucket, obj.region and obj.endpoint_url (or AWS_ENDPOINT_URL)")


def _read_by(body: Any, deadline: float, max_bytes: int) -> bytes:
    """A response body, read in the pieces that arrive, up to its first `max_bytes` bytes;
    TimeoutError once `deadline` (time.monotonic()) has passed, however steadily it trickles
    in."""
    pieces, num_read = [], 0
    while num_read < max_bytes and (piece := body.read1(min(_READ_PIECE, max_bytes - num_read))):
        pieces.append(piece)
        num_read += len(piece)
        if time.monotonic() > deadline:
            raise TimeoutError("the object was still arriving at the job's deadline")
    return b"".join(pieces)


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
