"""Small HTTP helpers for real-server tests: one keep-alive session per thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import requests

_local = threading.local()
T = TypeVar("T")


def session() -> requests.Session:
    if not hasattr(_local, "session"):
        _local.session = requests.Session()
    return _local.session


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any
    batch_size: int | None


def post_image(url: str, image: bytes, content_type: str = "application/octet-stream") -> Reply:
    answer = session().post(url, data=image, headers={"Content-Type": content_type}, timeout=120)
    batch_size = answer.headers.get("X-Batch-Size")
    return Reply(answer.status_code, answer.json(), int(batch_size) if batch_size else None)


def concurrently(calls: Sequence[Callable[[], T]], clients: int) -> list[T]:
    """Run the calls from `clients` threads at once; replies in call order."""
    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(lambda call: call(), calls))
