"""A real redis-server for tests, on a free 127.0.0.1 port, with no persistence; stopped after."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from torchserve_vision.torchserve_config import free_ports
from torchserve_vision.waiting import wait_until

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@dataclass
class RedisServer:
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, 10, f"redis-server on port {self.port}", interval_s=0.05)

    def kill(self) -> None:
        """SIGKILL, as a crashed or unreachable Redis."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=1)


@contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_ports(1)[0], directory)
    server.start()
    try:
        yield server
    finally:
        server.kill()
