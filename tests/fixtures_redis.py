"""A real redis-server on a free loopback port, real Celery worker processes, and a model
slow enough for a test to catch a shard mid-generation.

Loaded as a pytest plugin by conftest.py. Nothing here is mocked: the job tests talk to the
same Redis and Celery a deployment uses."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll until predicate() is truthy; its value is returned. A deadline, not a timing
    assertion: it only bounds how long a broken run takes to fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class RedisServer:
    """A redis-server with AOF persistence (appendonly yes, appendfsync everysec, as
    docs/operations.md recommends) in `folder`, that can be killed and restarted on the same
    port and data directory."""

    def __init__(self, folder, port: int | None = None, args: tuple[str, ...] = ()):
        self.folder, self.port = str(folder), port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.args = args          # more redis-server options (e.g. --replicaof HOST PORT)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20) -> RedisServer:
        import redis
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "everysec", "--dir", self.folder,
             *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(host="127.0.0.1", port=self.port)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited ({self.proc.returncode})")
            try:
                return client.ping()
            except redis.exceptions.BusyLoadingError:
                return False
            except redis.ConnectionError:
                return False
        wait_until(up, timeout, "redis-server to accept connections", 0.05)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


_PROXY = """
import asyncio, sys
listen, target = int(sys.argv[1]), int(sys.argv[2])
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except OSError:
        pass
    finally:
        w.close()
async def handle(cr, cw):
    try:
        sr, sw = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        cw.close()
        return
    await asyncio.gather(pipe(cr, sw), pipe(sr, cw))
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


class TcpProxy:
    """A TCP proxy from a port of its own to `target` on the loopback: one host's path to
    Redis, cut (kill: its connections reset, new ones refused, as a host's network that
    rejects) and restored (start again) while Redis serves everyone else."""

    def __init__(self, target: int):
        self.target, self.port = target, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> TcpProxy:
        import redis
        self.proc = subprocess.Popen([sys.executable, "-c", _PROXY, str(self.port),
                                      str(self.target)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

        def up():
            try:
                return redis.Redis(port=self.port).ping()
            except redis.ConnectionError:
                return False
        wait_until(up, 20, "the proxy to forward", 0.05)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a private redis-server (no persistence), stopped at the end of the session."""
    if not os.path.exists(REDIS_SERVER):
        pytest.fail("redis-server is not installed (apt-get install redis-server); the job "
                    "tests need a real one")
    import redis
    port = free_port()
    folder = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def up():
        try:
            return client.ping()
        except redis.ConnectionError:
            return False
    try:
        wait_until(up, 20, "redis-server to accept connections")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def redis_sentinel(redis_server, tmp_path_factory):
    """sentinel:// URL of a Redis Sentinel watching redis_server as master 'mymaster'."""
    import redis
    port, master_port = free_port(), int(redis_server.rsplit(":", 1)[1].split("/")[0])
    folder = tmp_path_factory.mktemp("sentinel")
    conf = folder / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                    f"sentinel monitor mymaster 127.0.0.1 {master_port} 1\n")
    proc = subprocess.Popen([REDIS_SERVER, str(conf), "--sentinel"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)

    def up():
        try:
            return client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")
        except redis.ConnectionError:
            return False
    try:
        wait_until(up, 20, "redis sentinel to know the master")
        yield f"sentinel://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


class Worker:
    """`batchspec worker` in its own process group, logging to a file."""

    def __init__(self, url: str, log_path: str, name: str, env: dict | None = None,
                 pool: str = "prefork"):
        self.log_path, self.name = log_path, name
        self.log = open(log_path, "ab")
        cmd = [sys.executable, "-m", "batchspec.cli", "worker", "--broker", url,
               "--pool", pool, "--concurrency", "1", "--loglevel", "INFO",
               "--hostname", f"{name}@test"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 120):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited: {self.tail()}")
            with open(self.log_path, "rb") as f:
                return b" ready." in f.read()
        wait_until(ready, timeout, "the worker to be ready", 0.2)
        return self

    def tail(self, n: int = 3000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def pids(self) -> set[int]:
        """The worker's process and its pool children."""
        pids = {self.proc.pid}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                            pids.add(int(entry))
                except OSError:
                    continue
        return pids

    def kill(self):
        """kill -9 the worker and its pool children (the whole process group, as when the
        host dies)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def start_worker(redis_server, tmp_path_factory):
    """start_worker(name, url=None, **env) -> a ready Worker on `url` (default: database 0
    of the test Redis); every worker is stopped after the module."""
    workers: list[Worker] = []
    folder = tmp_path_factory.mktemp("workers")

    def start(name: str = "w", pool: str = "prefork", url: str | None = None, **env) -> Worker:
        w = Worker(url or redis_server, str(folder / f"{name}.log"), name, env, pool)
        workers.append(w)
        return w.wait_ready()

    yield start
    for w in workers:
        w.stop()


@pytest.fixture(scope="session")
def slow_model(model_factory):
    """A model large enough (19M parameters) that a shard of a few hundred tokens takes
    seconds, for the tests that must catch a shard mid-generation (kill, cancel): the tiny
    model finishes such a shard before a test can see it running. Greedy, it runs to
    max_tokens on those tests' rows (no early EOS)."""
    return model_factory("llama", hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=6,
                         seed=2)
