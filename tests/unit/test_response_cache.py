"""The response cache: keys, the bounded LRU, the circuit breaker, a real Redis tier (and a dead
one), settings with environment overrides, and the handler in-process with the cache on (hits
answered without decoding; errors never cached; bypass)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from handlers.cache.cache_settings import CacheSettings, parse_cache_section, with_environment
from handlers.cache.cache_stage import CacheStage
from handlers.cache.response_cache import (
    CircuitBreaker,
    MemoryLru,
    RedisTier,
    ResponseCache,
    cache_key,
    namespace_of,
)
from handlers.ground.limits import SettingsError
from tests.images import photo_bytes
from tests.redis_server import redis_server
from torchserve_vision.local_handler import LocalContext, archive_context
from torchserve_vision.torchserve_config import free_ports


# --- keys, LRU, breaker -----------------------------------------------------------------------------
def test_keys_differ_by_model_version_settings_options_and_bytes():
    base = namespace_of("m", "1.0", {"top_k": 5})
    assert base == namespace_of("m", "1.0", {"top_k": 5})
    namespaces = {base, namespace_of("m", "2.0", {"top_k": 5}), namespace_of("n", "1.0", {"top_k": 5}),
                  namespace_of("m", "1.0", {"top_k": 3})}
    assert len(namespaces) == 4
    key = cache_key(base, "[5]", b"image")
    assert key == cache_key(base, "[5]", b"image")
    assert len({key, cache_key(base, "[3]", b"image"), cache_key(base, "[5]", b"imagf")}) == 3


def test_the_memory_tier_is_bounded_by_bytes_and_evicts_the_least_recently_used():
    lru = MemoryLru(max_bytes=30)
    lru.put("a", b"x" * 9)   # 10 bytes with its key
    lru.put("b", b"x" * 9)
    lru.get("a")             # a is now the most recent
    lru.put("c", b"x" * 9)
    lru.put("d", b"x" * 9)   # 40 > 30: evicts b, the least recently used
    assert lru.get("b") is None and lru.get("a") is not None
    assert lru.bytes <= 30
    lru.put("huge", b"x" * 100)   # larger than the whole tier: not stored, nothing evicted
    assert lru.get("huge") is None and lru.bytes == 30


def test_the_breaker_opens_after_consecutive_errors_and_retries_after_the_pause():
    now = [0.0]
    breaker = CircuitBreaker(errors_to_open=2, open_s=5, clock=lambda: now[0])
    assert breaker.failed() is False and breaker.allows()
    breaker.succeeded()
    assert breaker.failed() is False and breaker.failed() is True  # two in a row
    assert not breaker.allows()
    now[0] = 5.0
    assert breaker.allows()


# --- Redis ---------------------------------------------------------------------------------------
def test_a_real_redis_shares_entries_between_caches_in_one_round_trip_each(tmp_path):
    with redis_server(tmp_path) as server:
        settings = CacheSettings(enabled=True, memory_bytes=0, redis_url=server.url, ttl_s=60)
        writer, reader = ResponseCache(settings), ResponseCache(settings)
        writer.store({"k1": b"[1]", "k2": b"[2]"})
        assert reader.lookup(["k1", "k2", "k3"]) == {"k1": b"[1]", "k2": b"[2]"}
        assert reader.take_counts()["RedisHits"] == 2
        assert 55 <= server.client().ttl("k1") <= 60
        commands = server.client().info("commandstats")
        assert commands["cmdstat_mget"]["calls"] == 1 and commands["cmdstat_set"]["calls"] == 2


def test_a_dead_redis_never_raises_and_the_breaker_stops_trying(tmp_path):
    dead_url = f"redis://127.0.0.1:{free_ports(1)[0]}/0"
    tier = RedisTier(dead_url, timeout_ms=50, ttl_s=60, breaker=CircuitBreaker(2, 60))
    cache = ResponseCache(CacheSettings(enabled=True, memory_bytes=1000), tier)
    for _ in range(5):
        cache.store({"k": b"[1]"})
        assert cache.lookup(["other"]) == {}
    counts = cache.take_counts()
    assert counts["RedisErrors"] == 2 and counts["RedisSkipped"] == 8
    assert cache.lookup(["k"]) == {"k": b"[1]"}  # the memory tier still answers


# --- settings --------------------------------------------------------------------------------------
def test_settings_and_environment_overrides():
    assert parse_cache_section(None).enabled is False
    assert parse_cache_section(True) == CacheSettings(enabled=True)
    section = parse_cache_section({"memory_bytes": 1024, "redis_url": "redis://r:6379/0"})
    assert (section.enabled, section.memory_bytes, section.redis_url) == (True, 1024, "redis://r:6379/0")
    environment = {"TSV_CACHE": "on", "TSV_CACHE_REDIS_URL": "", "TSV_CACHE_TTL_S": "30",
                   "TSV_CACHE_MEMORY_BYTES": "2048"}
    applied = with_environment(section, environment)
    assert (applied.redis_url, applied.ttl_s, applied.memory_bytes) == (None, 30, 2048)
    assert with_environment(section, {"TSV_CACHE": "off"}).enabled is False
    for bad in ({"memory_bytes": -1}, {"colour": "red"}, "yes"):
        with pytest.raises(SettingsError):
            parse_cache_section(bad)
    with pytest.raises(SettingsError):
        with_environment(section, {"TSV_CACHE": "maybe"})


# --- the handler ----------------------------------------------------------------------------------
@pytest.fixture()
def cached_classifier(tiny_classifier, monkeypatch):
    """The tiny classifier with an in-worker cache, counting decodes."""
    monkeypatch.setattr(tiny_classifier, "cache",
                        CacheStage(ResponseCache(CacheSettings(enabled=True)), "tiny:1.0:test",
                                   tiny_classifier.near_duplicate_image))
    decoded: list[int] = []
    original = tiny_classifier.decode_images

    def counting(encoded):
        decoded.extend(1 for _ in encoded)
        return original(encoded)

    monkeypatch.setattr(tiny_classifier, "decode_images", counting)
    return tiny_classifier, decoded


def run(handler, bodies: list[Any], headers: list[dict[str, str]] | None = None
        ) -> tuple[list[Any], LocalContext]:
    context = archive_context(handler.model_dir, request_headers=headers or [{} for _ in bodies])
    return [json.loads(b) for b in handler.handle([{"body": body} for body in bodies], context)], context


def test_a_repeat_is_answered_from_the_cache_without_decoding(cached_classifier):
    handler, decoded = cached_classifier
    image = photo_bytes("coffee.png")
    (first,), context = run(handler, [bytearray(image)])
    assert context.response_headers[0]["X-Cache"] == "miss" and len(decoded) == 1
    answers, context = run(handler, [bytearray(image), bytearray(photo_bytes("chelsea.png"))])
    assert [context.response_headers[i]["X-Cache"] for i in range(2)] == ["hit", "miss"]
    assert answers[0] == first and len(decoded) == 2      # only chelsea was decoded
    as_json = {"data": base64.b64encode(image).decode()}
    (again,), context = run(handler, [as_json])           # same bytes, another body form
    assert again == first and context.response_headers[0]["X-Cache"] == "hit"


def test_options_errors_and_bypass(cached_classifier):
    handler, decoded = cached_classifier
    image = photo_bytes("rocket.jpg")
    run(handler, [bytearray(image)])
    (fewer,), context = run(handler, [{"data": base64.b64encode(image).decode(), "top_k": 2}])
    assert context.response_headers[0]["X-Cache"] == "miss" and len(fewer) == 2
    for _ in range(2):
        (_, ), context = run(handler, [bytearray(b"junk")])
        assert context.status(0) == 400
    assert len(decoded) == 4  # the failed request was decoded both times: errors are not cached
    (_,), context = run(handler, [bytearray(image)], [{"Cache-Control": "no-cache"}])
    assert context.response_headers[0]["X-Cache"] == "bypass" and len(decoded) == 5


def test_the_batch_log_counts_hits_and_misses(cached_classifier, caplog):
    handler, _ = cached_classifier
    image = bytearray(photo_bytes("astronaut.png"))
    run(handler, [image])
    with caplog.at_level("INFO", logger="handlers.serving"):
        run(handler, [image, image, bytearray(photo_bytes("coffee.png"))])
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch ")]
    record = json.loads(line.removeprefix("batch "))
    assert record["counters"]["CacheMemoryHits"] == 2 and record["counters"]["CacheMisses"] == 1
    assert record["gauges"]["CacheMemoryBytes"] > 0 and record["answered"] == 3


def test_the_tiny_classifier_serves_without_a_cache_by_default(tiny_classifier, tmp_path: Path):
    assert tiny_classifier.cache is None
    (_,), context = run(tiny_classifier, [bytearray(photo_bytes("coffee.png"))])
    assert "X-Cache" not in context.response_headers[0]


# --- near-duplicates --------------------------------------------------------------------------------
def decoded(image: bytes):
    import torch

    from handlers.ground.limits import ImageLimits
    from handlers.request.decode import decode_image_bytes

    return decode_image_bytes(image, ImageLimits(), torch.device("cpu"))


def reencoded(name: str, quality: int = 90, scale: float = 1.0) -> bytes:
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(photo_bytes(name))).convert("RGB")
    if scale != 1.0:
        image = image.resize((round(image.width * scale), round(image.height * scale)),
                             Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def test_the_perceptual_hash_keeps_a_photo_through_reencoding_and_rescaling_and_tells_photos_apart():
    from handlers.cache.perceptual_hash import hamming_distance, perceptual_hash

    names = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]
    hashes = {name: perceptual_hash(decoded(photo_bytes(name))) for name in names}
    for name in names:
        assert hamming_distance(hashes[name], perceptual_hash(decoded(reencoded(name, 75)))) <= 4
        assert hamming_distance(hashes[name], perceptual_hash(decoded(reencoded(name, 90, 0.5)))) <= 4
    assert min(hamming_distance(hashes[a], hashes[b]) for a in names for b in names if a < b) >= 16


def test_near_duplicate_mode_answers_a_reencoded_photo_from_the_cache(cached_classifier, monkeypatch):
    from handlers.cache.perceptual_hash import perceptual_hash

    handler, _ = cached_classifier
    monkeypatch.setattr(handler.cache.cache, "near_duplicates", True)
    original, copy = photo_bytes("chelsea.png"), reencoded("chelsea.png", 95)
    assert perceptual_hash(decoded(original)) == perceptual_hash(decoded(copy))  # the premise
    (first,), _ = run(handler, [bytearray(original)])
    (again,), context = run(handler, [bytearray(copy)])
    assert context.response_headers[0]["X-Cache"] == "near-hit" and again == first
    (other,), context = run(handler, [bytearray(photo_bytes("coffee.png"))])
    assert context.response_headers[0]["X-Cache"] == "miss" and other != first


def test_an_answer_is_serialised_once_and_a_hit_is_sent_as_stored(cached_classifier, monkeypatch):
    from handlers.batch import request_slot

    handler, _ = cached_classifier
    image = bytearray(photo_bytes("coffee.png"))
    serialised: list[object] = []
    real = request_slot.json.dumps

    def counted(value, *args, **kwargs):
        if isinstance(value, list):            # an answer (not a log line's dict)
            serialised.append(value)
        return real(value, *args, **kwargs)

    monkeypatch.setattr(request_slot.json, "dumps", counted)
    context = archive_context(handler.model_dir, request_headers=[{}])
    (miss,) = handler.handle([{"body": image}], context)
    assert context.response_headers[0]["X-Cache"] == "miss" and len(serialised) == 1  # stored = sent
    context = archive_context(handler.model_dir, request_headers=[{}])
    (hit,) = handler.handle([{"body": bytearray(image)}], context)
    assert context.response_headers[0]["X-Cache"] == "hit" and len(serialised) == 1   # sent as stored
    assert hit == miss
