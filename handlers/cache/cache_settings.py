"""Response-cache settings: the archive's `handler.cache` section, then deployment overrides from
the environment (read once, when the worker loads).

    handler:
      cache:
        enabled: true              # absent section: no cache
        memory_bytes: 67108864     # the in-worker LRU's bound (keys + answers), 0: no memory tier
        ttl_s: 3600                # Redis entries expire after this
        redis_url: redis://10.0.0.5:6379/0   # optional shared tier; none: in-worker only
        redis_timeout_ms: 50       # per Redis call (connect, read, write)
        breaker_errors: 3          # consecutive Redis errors that open the circuit breaker
        breaker_open_s: 10         # how long Redis is left alone after that
        near_duplicates: false     # classification only: also key by a perceptual hash of the
                                   # decoded image (re-encoded / rescaled frames hit; see docs)

Environment (for deployments; each wins over the archive): TSV_CACHE (on / off),
TSV_CACHE_REDIS_URL (empty: none), TSV_CACHE_TTL_S, TSV_CACHE_MEMORY_BYTES.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from handlers.ground.limits import SettingsError

DEFAULT_MEMORY_BYTES = 64 * 1024 * 1024
ON_WORDS, OFF_WORDS = {"1", "on", "true", "yes"}, {"0", "off", "false", "no"}


@dataclass(frozen=True)
class CacheSettings:
    enabled: bool = False
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    ttl_s: int = 3600
    redis_url: str | None = None
    redis_timeout_ms: int = 50
    breaker_errors: int = 3
    breaker_open_s: float = 10.0
    near_duplicates: bool = False


def _non_negative_int(value: Any, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise SettingsError(f"'{name}' must be a whole number >= 0, got {value!r}") from None
    if isinstance(value, bool) or number < 0:
        raise SettingsError(f"'{name}' must be a whole number >= 0, got {value!r}")
    return number


def parse_cache_section(section: Any) -> CacheSettings:
    """The `cache:` section (absent or false: disabled; true: the defaults)."""
    if section in (None, False):
        return CacheSettings()
    if section is True:
        return CacheSettings(enabled=True)
    if not isinstance(section, Mapping):
        raise SettingsError(f"'cache' must be true, false or a mapping, got {section!r}")
    unknown = set(section) - set(CacheSettings.__dataclass_fields__)
    if unknown:
        raise SettingsError(f"unknown 'cache' settings: {sorted(unknown)}")
    defaults = CacheSettings()
    redis_url = section.get("redis_url")
    return CacheSettings(
        enabled=bool(section.get("enabled", True)),
        memory_bytes=_non_negative_int(section.get("memory_bytes", defaults.memory_bytes),
                                       "cache.memory_bytes"),
        ttl_s=max(1, _non_negative_int(section.get("ttl_s", defaults.ttl_s), "cache.ttl_s")),
        redis_url=str(redis_url) if redis_url else None,
        redis_timeout_ms=max(1, _non_negative_int(section.get("redis_timeout_ms", 50),
                                                  "cache.redis_timeout_ms")),
        breaker_errors=max(1, _non_negative_int(section.get("breaker_errors", 3),
                                                "cache.breaker_errors")),
        breaker_open_s=float(_non_negative_int(section.get("breaker_open_s", 10),
                                               "cache.breaker_open_s")),
        near_duplicates=bool(section.get("near_duplicates", False)),
    )


def with_environment(settings: CacheSettings, environment: Mapping[str, str]) -> CacheSettings:
    """`settings` with the deployment's TSV_CACHE* variables applied (SettingsError if malformed)."""
    switch = environment.get("TSV_CACHE", "").strip().lower()
    if switch and switch not in ON_WORDS | OFF_WORDS:
        raise SettingsError(f"TSV_CACHE must be on or off, got {switch!r}")
    if switch:
        settings = replace(settings, enabled=switch in ON_WORDS)
    if "TSV_CACHE_REDIS_URL" in environment:
        settings = replace(settings, redis_url=environment["TSV_CACHE_REDIS_URL"].strip() or None)
    if "TSV_CACHE_TTL_S" in environment:
        settings = replace(settings, ttl_s=max(1, _non_negative_int(environment["TSV_CACHE_TTL_S"],
                                                                    "TSV_CACHE_TTL_S")))
    if "TSV_CACHE_MEMORY_BYTES" in environment:
        settings = replace(settings, memory_bytes=_non_negative_int(
            environment["TSV_CACHE_MEMORY_BYTES"], "TSV_CACHE_MEMORY_BYTES"))
    return settings
