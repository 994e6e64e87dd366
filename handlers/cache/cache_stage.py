"""The response cache as stages of `handle` (see handlers.cache.response_cache for the tiers and keys).

`look_up` runs after parsing: each open request gets its key (the model's namespace, its options
as canonical text, its image bytes) and, when the cache has it, its answer, without decoding or
inference. `look_up_near_duplicates` runs after decoding, in near-duplicate mode: a second key
from the image's perceptual hash. `store` writes the computed answers (one write per batch).
Each request's status goes out in the `X-Cache` response header.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.batch.batch_record import BatchRecord
from handlers.batch.batch_stage import BatchStage
from handlers.batch.request_slot import HeaderReader, RequestSlot
from handlers.cache.cache_settings import parse_cache_section, with_environment
from handlers.cache.perceptual_hash import perceptual_hashes
from handlers.cache.response_cache import ResponseCache, cache_key, namespace_of
from handlers.request.request_options import canonical_text

logger = logging.getLogger(__name__)
CACHE_HEADER = "X-Cache"   # hit | near-hit | miss | bypass, when the model has a response cache
CACHE_HIT, CACHE_NEAR_HIT, CACHE_MISS, CACHE_BYPASS = "hit", "near-hit", "miss", "bypass"


def bypasses_cache(header: HeaderReader) -> bool:
    """`Cache-Control: no-cache` (or no-store): neither read nor write the cache for this request."""
    directives = (header("Cache-Control") or "").lower()
    return "no-cache" in directives or "no-store" in directives


@dataclass(frozen=True)
class CacheStage(BatchStage):
    cache: ResponseCache
    namespace: str          # see handlers.cache.response_cache.namespace_of
    # the image a near-duplicate key is hashed from (the handler's `near_duplicate_image`)
    image_of: Callable[[Any], torch.Tensor | None]
    name = "Cache"

    def parsed(self, slots: Sequence[RequestSlot], record: BatchRecord) -> None:
        self.look_up(slots, record)

    def decoded(self, slots: Sequence[RequestSlot], record: BatchRecord) -> None:
        self.look_up_near_duplicates(slots, self.image_of, record)

    def answered(self, slots: Sequence[RequestSlot], computed: Sequence[RequestSlot],
                 record: BatchRecord, metrics: Any) -> None:
        self.store(computed, record)

    def look_up(self, slots: Sequence[RequestSlot], record: BatchRecord) -> None:
        """Key every open, parsed request that does not bypass the cache; answer the hits."""
        with record.timing("cache"):
            keyed: list[RequestSlot] = []
            for slot in slots:
                if not slot.is_open or slot.parsed is None or slot.several:
                    continue   # several images in one request are not cached
                if bypasses_cache(slot.header):
                    slot.cache_status = CACHE_BYPASS
                    continue
                slot.cache_status = CACHE_MISS
                slot.cache_keys.append(cache_key(self.namespace, canonical_text(slot.parsed.options),
                                                 slot.parsed.images[0]))
                keyed.append(slot)
            hits = self.answer_found(keyed, CACHE_HIT)
        record.counters["CacheBypasses"] = sum(slot.cache_status == CACHE_BYPASS for slot in slots)
        record.counters["CacheMisses"] = len(keyed) - hits

    def look_up_near_duplicates(self, slots: Sequence[RequestSlot],
                                image_of: Callable[[Any], torch.Tensor | None],
                                record: BatchRecord) -> None:
        """In near-duplicate mode: a second key per decoded, keyed request (the perceptual hash of
        `image_of(slot.decoded[0])`, see handlers.cache.perceptual_hash); hits are answered."""
        if not self.cache.near_duplicates:
            return
        with record.timing("cache"):
            keyed: list[RequestSlot] = []
            images: list[torch.Tensor] = []
            for slot in slots:
                image = image_of(slot.decoded[0]) if slot.is_open and slot.cache_keys else None
                if image is not None and slot.parsed is not None:
                    keyed.append(slot)
                    images.append(image)
            for slot, image_hash in zip(keyed, perceptual_hashes(images), strict=True):
                assert slot.parsed is not None
                options = canonical_text(slot.parsed.options) + "|phash"
                slot.cache_keys.append(cache_key(self.namespace, options, image_hash))
            hits = self.answer_found(keyed, CACHE_NEAR_HIT)
        record.counters["CacheNearDuplicateHits"] = hits
        record.counters["CacheMisses"] -= hits

    def answer_found(self, keyed: Sequence[RequestSlot], status: str) -> int:
        """Answer the requests whose last key the cache has (one lookup); how many it had."""
        found = self.cache.lookup([slot.cache_keys[-1] for slot in keyed])
        hits = [slot for slot in keyed if slot.cache_keys[-1] in found]
        for slot in hits:
            stored = found[slot.cache_keys[-1]]
            slot.answer_with(json.loads(stored), serialised=stored)
            slot.cache_status = status
        return len(hits)

    def store(self, computed: Sequence[RequestSlot], record: BatchRecord) -> None:
        """Store the computed answers of keyed requests under every key they have; count."""
        entries = {key: slot.answer_bytes() for slot in computed for key in slot.cache_keys}
        self.cache.store(entries)
        record.counters.update({f"Cache{name}": count
                                for name, count in self.cache.take_counts().items()})
        record.gauges["CacheMemoryBytes"] = self.cache.memory_bytes


def cache_stage_for(handler_section: Mapping[str, Any], model_name: str, model_version: str,
                    image_of: Callable[[Any], torch.Tensor | None]) -> CacheStage | None:
    """The cache of a model version from its `handler.cache` section (TSV_CACHE_* environment
    variables override it); None when the cache is off."""
    settings = with_environment(parse_cache_section(handler_section.get("cache")), os.environ)
    if not settings.enabled:
        return None
    logger.info("response cache on: memory_bytes=%d redis=%s ttl_s=%d", settings.memory_bytes,
                settings.redis_url or "none", settings.ttl_s)
    return CacheStage(ResponseCache(settings), namespace_of(model_name, model_version, handler_section),
                      image_of)
