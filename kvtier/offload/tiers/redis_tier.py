"""The redis tier: one value per chunk in Valkey or Redis, a single server or a cluster, shared by
every instance that uses the server.

Keys are `<key_prefix>:<namespace hex>:<sha256(key)>` (in a cluster they spread over the hash
slots) and values hold the checked chunk format. Each load is one pipelined EXISTS and
GETRANGE (up to one byte past the longest valid chunk: a larger value is never read whole) and
each store one SET (with `EX ttl_s` when set) on the tier's thread pools, the existence checks
of a step one pipelined batch of EXISTS (tiers/remote.py). Capacity is the server's:
`maxmemory` with `maxmemory-policy allkeys-lru` evicts the least recently used chunks, `ttl_s`
expires them.

The URL picks the server: `redis://HOST:PORT/DB`, `rediss://...` (TLS),
`redis+cluster://HOST:PORT` (any node of a cluster; `rediss+cluster://` with TLS). The password
comes from `password_file` or the environment variable `password_env`, never from the URL (it
would show in process listings and logs). Refused credentials, a failed TLS handshake, a
database the server does not have and a URL of the wrong kind for the server (one server's at a
cluster node, or the other way round) are errors at start-up; a server that does not answer is a
miss until it does.

No call is retried after a timeout, which would stretch it past its deadline: a single server's
client retries once after a broken connection, a cluster's client never (redis-py's cluster
client retries timeouts too, and refreshes the slot map in between).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import SplitResult, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry

from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.common.options import is_positive_int, require
from kvtier.offload.keys import ChunkKey, key_digest
from kvtier.offload.tiers.base import TierContext
from kvtier.offload.tiers.remote import MissingChunk, RemoteTier, check_remote_options

logger = logging.getLogger(__name__)

_SCHEMES = {"redis": (False, False), "rediss": (True, False),
            "redis+cluster": (False, True), "rediss+cluster": (True, True)}
_TLS_FILES = ("ssl_ca_file", "ssl_cert_file", "ssl_key_file")
# Errors that say the server (or cluster) cannot answer now, rather than refused one request.
_OUTAGES = (redis.ConnectionError, redis.TimeoutError, RedisClusterException, ClusterDownError,
            TryAgainError)


class RedisTierError(ValueError):
    """The redis tier's server or URL is set up wrong (raised at start-up)."""


@dataclass(frozen=True)
class RedisTierOptions:
    url: str
    key_prefix: str = "kvtier"
    # Seconds a chunk lives after its store; None: until the server evicts it.
    ttl_s: int | None = None
    username: str | None = None
    # A file whose first line is the password; None: the environment variable password_env.
    password_file: str | None = None
    password_env: str = "REDIS_PASSWORD"
    # TLS (also chosen by a rediss:// URL). ssl_ca_file: the CA bundle that signed the server's
    # certificate (None: the system's); ssl_cert_file / ssl_key_file: this client's certificate
    # and key, for a server that asks for one (tls-auth-clients).
    ssl: bool = False
    ssl_ca_file: str | None = None
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    connect_timeout_s: float = 2.0
    timeout_s: float = 5.0
    num_read_threads: int = 8
    num_write_threads: int = 4
    write_nice: int = 10
    max_index_entries: int = 1_000_000
    max_pending_checks: int = 4096

    def __post_init__(self) -> None:
        parts = urlsplit(self.url) if isinstance(self.url, str) else None
        require(parts is not None and parts.scheme in _SCHEMES and bool(parts.hostname),
                "redis.url", f"must be a URL with a scheme in {sorted(_SCHEMES)} and a host, "
                             f"e.g. redis://127.0.0.1:6379/0", self.url)
        if parts.password is not None:
            raise ValueError("redis.url must not carry a password (process listings and logs "
                             "would show it); put it in password_file or the environment "
                             f"variable {self.password_env}")
        _check_url_parts(self.url, parts)
        require(self.ttl_s is None or is_positive_int(self.ttl_s), "redis.ttl_s",
                "must be an integer number of seconds >= 1 or null", self.ttl_s)
        require(isinstance(self.ssl, bool), "redis.ssl", "must be true or false", self.ssl)
        for name in _TLS_FILES:
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value != ""), f"redis.{name}",
                    "must be a file path or null", value)
            require(value is None or self.ssl or _SCHEMES[parts.scheme][0], f"redis.{name}",
                    "needs TLS: use a rediss:// URL or set ssl to true", value)
        require(self.ssl_key_file is None or self.ssl_cert_file is not None,
                "redis.ssl_key_file", "needs ssl_cert_file (the certificate of that key)",
                self.ssl_key_file)
        check_remote_options(self, "redis")


class RedisTier(RemoteTier):
    options_cls: ClassVar[type] = RedisTierOptions

    def __init__(self, options: RedisTierOptions, context: TierContext) -> None:
        self._settings = _client_settings(options)
        super().__init__(options, context, store_kind="redis")
        self.endpoint = options.url
        self._prefix = f"{options.key_prefix}:{context.namespace.hex()}:"
        self._client_lock = threading.Lock()
        self._client: Any = None
        # Runs each batch of existence checks, so that the probe thread waits for no more than
        # `_check_deadline_s` however long the client takes (a cluster's refresh of its slot
        # map asks each node in turn).
        self._exists_runner = DaemonThreadPool(1, f"kvtier-{context.name}-exists")
        self._check_deadline_s = options.connect_timeout_s + options.timeout_s + 1.0
        try:
            problem = self._wrong_kind_of_server()
        except Exception as exc:  # redis-py's errors, and RedisClusterException for a cluster
            problem = self._start_up_problem(exc)
            if problem is None:
                logger.warning("redis tier: cannot reach %s (%s); the tier misses until the "
                               "server answers", self.endpoint, exc)
                return
        if problem is not None:
            self.shutdown()
            raise RedisTierError(f"redis tier: {self.endpoint} {problem}") from None

    def _wrong_kind_of_server(self) -> str | None:
        """Ping the server; what to fix when a redis:// URL names a cluster node (which would
        answer most keys with MOVED), else None."""
        client = self._connected()
        client.ping()
        if self._settings[0]:
            return None
        try:
            in_cluster = client.info("cluster").get("cluster_enabled")
        except NoPermissionError:
            return None  # an ACL user without INFO: MOVED errors will say it, if it is so
        if not in_cluster:
            return None
        return "is a node of a cluster; name it as redis+cluster://HOST:PORT"

    def _start_up_problem(self, exc: Exception) -> str | None:
        """What the user must fix when the first call failed with `exc`; None when the server
        is only unreachable (down, starting, a network fault), which costs misses until it
        answers."""
        options = self.options
        if (isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc)
                or "WRONGPASS" in str(exc)):
            if self._settings[1]["password"] is None:
                return f"needs a password; put it in password_file or ${options.password_env}"
            return (f"refused the credentials ({exc}); fix password_file or "
                    f"${options.password_env} (and username if the server's ACLs need one)")
        cause = _ssl_cause(exc)
        if isinstance(cause, ssl.SSLCertVerificationError):
            return (f"has a certificate this client cannot verify ({cause.verify_message}); "
                    f"set ssl_ca_file to the CA bundle that signed it")
        if cause is not None:
            return (f"refused the TLS handshake ({cause}); check that the server speaks TLS on "
                    f"this port, and set ssl_cert_file and ssl_key_file if it asks clients for "
                    f"a certificate")
        if "Cluster mode is not enabled" in str(exc):
            return "is not a cluster node; name a single server as redis://HOST:PORT/DB"
        if "DB index is out of range" in str(exc):
            return (f"has no database {self._settings[1]['db']} ({exc}); name one below the "
                    f"server's `databases` setting (16 by default) in the URL")
        if isinstance(exc, redis.ResponseError) and not self._is_outage(exc):
            return f"refused the tier's first call ({exc}); fix the URL or the server's settings"
        return None

    def _connected(self) -> Any:
        """The client, built on first use (a cluster client asks a node for the slot map, so
        it is retried after a start with the cluster down)."""
        with self._client_lock:
            if self._client is None:
                is_cluster, kwargs = self._settings
                self._client = RedisCluster(**kwargs) if is_cluster else redis.Redis(**kwargs)
            return self._client

    def _name(self, key: ChunkKey) -> str:
        return self._prefix + key_digest(key)

    def _put(self, key: ChunkKey, data: bytes) -> None:
        self._connected().set(self._name(key), data, ex=self.options.ttl_s)

    def _get(self, name: str, max_bytes: int) -> bytes:
        # GETRANGE, not GET: a larger value is never read whole. It answers a missing key with
        # an empty value, so EXISTS tells one from an empty value (damage, deleted at load).
        pipe = self._connected().pipeline(transaction=False)
        pipe.exists(name)
        pipe.getrange(name, 0, max_bytes - 1)
        exists, data = pipe.execute()
        if not exists:
            raise MissingChunk(name)
        return data

    def _delete(self, names: Sequence[str]) -> None:
        pipe = self._connected().pipeline(transaction=False)
        for name in names:  # one key per command: a cluster's keys live on different nodes
            pipe.delete(name)
        pipe.execute()

    def _exists_many(self, names: Sequence[str]) -> list[bool]:
        answer = self._exists_runner.submit(self._exists_pipeline, names)
        try:
            return answer.result(timeout=self._check_deadline_s)
        except FutureTimeout:  # a running pipeline ends by itself, within the client's timeouts
            answer.cancel()  # one still queued behind it need not run
            raise redis.TimeoutError(f"existence checks unanswered after "
                                     f"{self._check_deadline_s:g} s") from None

    def _exists_pipeline(self, names: Sequence[str]) -> list[bool]:
        pipe = self._connected().pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]

    def _is_outage(self, exc: Exception) -> bool:
        return isinstance(exc, _OUTAGES)

    def shutdown(self) -> bool:
        stopped = super().shutdown()
        runner_stopped = self._exists_runner.shutdown(0.5, cancel_pending=True)
        if self._client is not None:
            self._client.close()
        return stopped and runner_stopped


def _client_settings(options: RedisTierOptions) -> tuple[bool, dict[str, Any]]:
    """(is a cluster, keyword arguments of the redis-py client) for `options`."""
    parts = urlsplit(options.url)
    use_ssl, is_cluster = _SCHEMES[parts.scheme]
    kwargs: dict[str, Any] = {
        "host": parts.hostname, "port": parts.port or 6379,
        "username": options.username or (unquote(parts.username) if parts.username else None),
        "password": _password(options),
        "socket_connect_timeout": options.connect_timeout_s,
        "socket_timeout": options.timeout_s,
        # A single server's client: one retry, on a broken connection only (a pooled connection
        # the server closed, e.g. across its restart). A cluster's client retries whatever its
        # own list holds, timeouts included, whatever supported_errors says: no retry at all.
        "retry": (Retry(NoBackoff(), 0) if is_cluster else
                  Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))),
    }
    if use_ssl or options.ssl:
        for name in _TLS_FILES:
            path = getattr(options, name)
            if path is not None and not os.access(path, os.R_OK):
                raise RedisTierError(f"redis tier: cannot read {name} {path!r}; name a "
                                     f"readable PEM file")
        kwargs.update(ssl=True, ssl_ca_certs=options.ssl_ca_file,
                      ssl_certfile=options.ssl_cert_file, ssl_keyfile=options.ssl_key_file)
    if not is_cluster:
        kwargs["db"] = int(parts.path.strip("/") or 0)
    return is_cluster, kwargs


def _check_url_parts(url: str, parts: SplitResult) -> None:
    """Refuse what a URL may say that the tier would not honour: a bad port or database, a
    database in a cluster's URL, options in a query."""
    try:
        port = parts.port
    except ValueError:
        port = 0
    require(port != 0, "redis.url", "port must be a number in 1..65535, e.g. "
                                    "redis://HOST:6379/0", url)
    require(not parts.query and not parts.fragment, "redis.url",
            "must not carry options after '?' or '#'; set them as keys of the tier's JSON form "
            "(timeout_s, connect_timeout_s, ...)", url)
    db = parts.path.strip("/")
    if _SCHEMES[parts.scheme][1]:
        require(db == "", "redis.url", "of a cluster names no database (a cluster has only "
                                       "database 0), e.g. redis+cluster://HOST:PORT", url)
    require(db == "" or db.isdigit(), "redis.url", "database must be a number, e.g. "
                                                   "redis://HOST:PORT/0", url)


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind `exc` (redis-py wraps it in a ConnectionError), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _password(options: RedisTierOptions) -> str | None:
    if options.password_file is not None:
        try:
            with open(options.password_file) as f:
                return f.readline().rstrip("\r\n")
        except OSError as exc:
            raise RedisTierError(f"redis tier: cannot read password_file "
                                 f"{options.password_file!r}: {exc.strerror}") from None
    return os.environ.get(options.password_env) or None
