"""A two-tier response cache: a bounded in-worker LRU, then an optional shared Redis.

Keys say what an answer depends on: the model's namespace (name, version and a digest of the
archive's handler settings: a different version or setting never sees another's entries, so a
rollout needs no flush), the request's options that change the answer, and a keyed BLAKE2b
digest of the image bytes. Values are answers as JSON bytes; only successful answers are stored.

A batch makes at most one Redis round trip to look up (MGET of the keys the memory tier did not
have) and one to store (a pipeline of SETs with expiry). Redis faults never fail a request: each
call has a short timeout, and after `breaker_errors` consecutive errors the circuit breaker
leaves Redis alone for `breaker_open_s` seconds; meanwhile requests are computed as if there were
no shared tier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from handlers.cache.cache_settings import CacheSettings

logger = logging.getLogger(__name__)


def namespace_of(model_name: str, model_version: str, handler_section: Mapping[str, Any]) -> str:
    """`<name>:<version>:<16 hex digits of the handler settings' digest>`."""
    settings = json.dumps(handler_section, sort_keys=True, default=str).encode()
    return f"{model_name}:{model_version}:{hashlib.sha256(settings).hexdigest()[:16]}"


def cache_key(namespace: str, options: str, image: bytes) -> str:
    """The key of one request: the namespace, a digest of its options, and BLAKE2b-128 of the
    image bytes keyed with both (so equal bytes under other options or models never collide)."""
    options_digest = hashlib.blake2b(options.encode(), digest_size=8).hexdigest()
    key = f"{namespace}:{options_digest}".encode()[:64]
    return f"tsv:{namespace}:{options_digest}:{hashlib.blake2b(image, digest_size=16, key=key).hexdigest()}"


class MemoryLru:
    """Least recently used entries, bounded by bytes (keys + values), not by count."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: OrderedDict[str, bytes] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        size = len(key) + len(value)
        if size > self.max_bytes:
            return
        if key in self.entries:
            self.bytes -= len(key) + len(self.entries.pop(key))
        self.entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            old_key, old_value = self.entries.popitem(last=False)
            self.bytes -= len(old_key) + len(old_value)


class CircuitBreaker:
    """Closed until `errors_to_open` consecutive failures; then open (calls skipped) for
    `open_s` seconds; then one call is let through, and its outcome closes or reopens it."""

    def __init__(self, errors_to_open: int, open_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.errors_to_open = errors_to_open
        self.open_s = open_s
        self.clock = clock
        self.consecutive_errors = 0
        self.open_until = 0.0

    def allows(self) -> bool:
        return self.clock() >= self.open_until

    def succeeded(self) -> None:
        self.consecutive_errors = 0

    def failed(self) -> bool:
        """Record a failure; True when it opened the breaker."""
        self.consecutive_errors += 1
        if self.consecutive_errors >= self.errors_to_open:
            self.open_until = self.clock() + self.open_s
            self.consecutive_errors = 0
            return True
        return False


class RedisTier:
    """MGET / pipelined SET EX against one Redis, behind a circuit breaker; never raises."""

    def __init__(self, url: str, timeout_ms: int, ttl_s: int, breaker: CircuitBreaker,
                 client: Any = None) -> None:
        if client is None:
            import redis

            timeout_s = timeout_ms / 1000
            client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                          socket_connect_timeout=timeout_s, retry_on_timeout=False)
        self.client = client
        self.url = url
        self.ttl_s = ttl_s
        self.breaker = breaker
        self.counts: Counter[str] = Counter()   # errors, skipped calls (breaker open)

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        if not self.breaker.allows():
            self.counts["RedisSkipped"] += 1
            return None
        try:
            result = call()
        except Exception as error:  # noqa: BLE001 - any Redis fault: compute without the cache
            self.counts["RedisErrors"] += 1
            opened = self.breaker.failed()
            logger.warning("response cache: redis %s failed (%s: %s)%s", what, type(error).__name__,
                           error, f"; leaving redis alone for {self.breaker.open_s:g} s"
                           if opened else "")
            return None
        self.breaker.succeeded()
        return result

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        values = self._call("lookup", lambda: self.client.mget(list(keys))) if keys else None
        return {key: value for key, value in zip(keys, values or [], strict=False) if value is not None}

    def put_many(self, entries: Mapping[str, bytes]) -> None:
        if not entries:
            return

        def store() -> None:
            pipeline = self.client.pipeline(transaction=False)
            for key, value in entries.items():
                pipeline.set(key, value, ex=self.ttl_s)
            pipeline.execute()

        self._call("store", store)


class ResponseCache:
    """The two tiers. `lookup` returns the hits of a batch's keys (memory first, then one Redis
    round trip for the rest; Redis hits are copied into memory); `store` writes new answers to
    both. `counts` accumulates what happened, for the batch's metrics."""

    def __init__(self, settings: CacheSettings, redis_tier: RedisTier | None = None) -> None:
        self.memory = MemoryLru(settings.memory_bytes) if settings.memory_bytes > 0 else None
        self.redis = redis_tier
        if self.redis is None and settings.redis_url:
            self.redis = RedisTier(settings.redis_url, settings.redis_timeout_ms, settings.ttl_s,
                                   CircuitBreaker(settings.breaker_errors, settings.breaker_open_s))
        self.counts: Counter[str] = Counter()
        self.near_duplicates = settings.near_duplicates

    def lookup(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The entries found for `keys` (which may repeat: hits are counted per key given)."""
        hits: dict[str, bytes] = {}
        if self.memory is not None:
            for key in dict.fromkeys(keys):
                value = self.memory.get(key)
                if value is not None:
                    hits[key] = value
        self.counts["MemoryHits"] += sum(key in hits for key in keys)
        rest = [key for key in dict.fromkeys(keys) if key not in hits]
        if self.redis is not None and rest:
            shared = self.redis.get_many(rest)
            self.counts["RedisHits"] += sum(key in shared for key in keys)
            for key, value in shared.items():
                hits[key] = value
                if self.memory is not None:
                    self.memory.put(key, value)
        return hits

    def store(self, entries: Mapping[str, bytes]) -> None:
        if self.memory is not None:
            for key, value in entries.items():
                self.memory.put(key, value)
        self.counts["StoredBytes"] += sum(len(value) for value in entries.values())
        if self.redis is not None:
            self.redis.put_many(entries)

    def take_counts(self) -> dict[str, int]:
        """What happened since the last call (Redis errors and skips included)."""
        counts = self.counts + (self.redis.counts if self.redis is not None else Counter())
        self.counts = Counter()
        if self.redis is not None:
            self.redis.counts = Counter()
        return dict(counts)

    @property
    def memory_bytes(self) -> int:
        return self.memory.bytes if self.memory is not None else 0
