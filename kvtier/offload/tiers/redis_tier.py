"""The redis tier: one value per chunk in Valkey or Redis, a single server or a cluster, shared by
every instance that uses the server.

Keys are `<key_prefix>:<namespace hex>:<sha256(key)>` (in a cluster they spread over the hash
slots) and values hold the checked chunk format. Each load is one GET and each store one SET
(with `EX ttl_s` when set) on the tier's thread pools, the existence checks of a step one
pipelined batch of EXISTS (tiers/remote.py). Capacity is the server's: `maxmemory` with
`maxmemory-policy allkeys-lru` evicts the least recently used chunks, `ttl_s` expires them.

The URL picks the server: `redis://HOST:PORT/DB`, `rediss://...` (TLS),
`redis+cluster://HOST:PORT` (any node of a cluster; `rediss+cluster://` with TLS). The password
comes from `password_file` or the environment variable `password_env`, never from the URL (it
would show in process listings and logs). Refused credentials and a failed TLS handshake are
errors at start-up; a server that does not answer is a miss until it does.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvtier.common.options import is_positive_int, require
from kvtier.offload.keys import ChunkKey, key_digest
from kvtier.offload.tiers.base import TierContext
from kvtier.offload.tiers.remote import MissingChunk, RemoteTier, check_remote_options

logger = logging.getLogger(__name__)

_SCHEMES = {"redis": (False, False), "rediss": (True, False),
            "redis+cluster": (False, True), "rediss+cluster": (True, True)}
_TLS_FILES = ("ssl_ca_file", "ssl_cert_file", "ssl_key_file")


class RedisTierError(ValueError):
    """The redis tier's server refused its credentials (raised at start-up)."""


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
        self.endpoint = urlsplit(options.url)._replace(query="").geturl()
        self._prefix = f"{options.key_prefix}:{context.namespace.hex()}:"
        self._client_lock = threading.Lock()
        self._client: Any = None
        try:
            self._connected().ping()
        except Exception as exc:  # redis-py's errors, and RedisClusterException for a cluster
            problem = self._start_up_problem(exc)
            if problem is None:
                logger.warning("redis tier: cannot reach %s (%s); the tier misses until the "
                               "server answers", self.endpoint, exc)
                return
            self.shutdown()
            raise RedisTierError(f"redis tier: {self.endpoint} {problem}") from None

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

    def _get(self, name: str) -> bytes:
        data = self._connected().get(name)
        if data is None:
            raise MissingChunk(name)
        return data

    def _delete(self, names: Sequence[str]) -> None:
        pipe = self._connected().pipeline(transaction=False)
        for name in names:  # one key per command: a cluster's keys live on different nodes
            pipe.delete(name)
        pipe.execute()

    def _exists_many(self, names: Sequence[str]) -> list[bool]:
        pipe = self._connected().pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]

    def shutdown(self) -> bool:
        stopped = super().shutdown()
        if self._client is not None:
            self._client.close()
        return stopped


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
        # One retry, on a broken connection only (a pooled connection the server closed, e.g.
        # across its restart); never on a timeout, which would stretch a call past its deadline.
        "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
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
        db = parts.path.strip("/")
        require(db == "" or db.isdigit(), "redis.url", "database must be a number, e.g. "
                                                       "redis://HOST:PORT/0", options.url)
        kwargs["db"] = int(db or 0)
    return is_cluster, kwargs


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
