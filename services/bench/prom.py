"""Encoder-cache hit ratio per item, from the cluster's Prometheus counters.

The coordinator counts every image item of every request once, by where its
embedding came from (`epd_coordinator_mm_items_total{source="known"|
"cache_hit"|"encoded"|"inline"}`: a handle it remembered, an encoder's cache,
the vision tower, prefill's inline encoder).  Over a run (after - before):

    items     = known + cache_hit + encoded + inline
    hit ratio = (known + cache_hit) / items

Encode's own counters (`epd_encode_items_total{result="cache_hit"|"encoded"}`)
count only what it was asked (not the images the coordinator knew), so they give
the ratio only where the coordinator's counters were not given (an older
coordinator: items = `epd_coordinator_ec_known_hits_total` +
`epd_coordinator_encode_calls_total`, hits = known + cache_hit; no coordinator:
items = cache_hit + encoded).  `encoded_ratio` = encoded / items is the share of
items that really ran the vision tower (encode's count).  Counters are summed
over all given URLs.

Videos are cached per frame group by encode (services/encode/frame_groups.py):
`epd_encode_frame_groups_total{result="cache_hit"|"encoded"}` gives the frame-group
hit ratio, hits / (hits + encoded), when an encode instance's /metrics is among the
URLs.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import aiohttp

KNOWN_HITS = "epd_coordinator_ec_known_hits_total"
ENCODE_CALLS = "epd_coordinator_encode_calls_total"
ENCODE_ITEMS = "epd_encode_items_total"
MM_ITEMS = "epd_coordinator_mm_items_total"
MM_SOURCES = ("known", "cache_hit", "encoded", "inline")
FRAME_GROUPS = "epd_encode_frame_groups_total"

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_text(text: str) -> Samples:
    """Prometheus text exposition -> {(name, sorted labels): value}."""
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
        try:
            samples[(match.group(1), labels)] = float(match.group(3))
        except ValueError:
            continue
    return samples


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> Samples:
    """All URLs' samples added up (same name and labels sum)."""
    total: Samples = {}
    texts = await asyncio.gather(*(_fetch(session, metrics_url(u)) for u in urls))
    for text in texts:
        for key, value in parse_text(text).items():
            total[key] = total.get(key, 0.0) + value
    return total


async def _fetch(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        return await resp.text()


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= set(ls)]
    return sum(found) if found else None


def counters(samples: Samples) -> dict[str, float | None]:
    return {"known_hits": _value(samples, KNOWN_HITS), "encode_calls": _value(samples, ENCODE_CALLS),
            "encoded": _value(samples, ENCODE_ITEMS, result="encoded"),
            "cache_hit": _value(samples, ENCODE_ITEMS, result="cache_hit"),
            **{f"items_{source}": _value(samples, MM_ITEMS, source=source) for source in MM_SOURCES},
            "frame_groups_hit": _value(samples, FRAME_GROUPS, result="cache_hit"),
            "frame_groups_encoded": _value(samples, FRAME_GROUPS, result="encoded")}


def delta(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, value in after.items():
        out[key] = None if value is None else value - (before.get(key) or 0.0)
    return out


def add_deltas(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if a.get(k) is None and b.get(k) is None else (a.get(k) or 0.0) + (b.get(k) or 0.0)
            for k in set(a) | set(b)}


def hit_ratio(d: dict[str, float | None]) -> dict[str, Any]:
    encoded = d.get("encoded")
    by_source = {source: d.get(f"items_{source}") for source in MM_SOURCES}
    if any(v is not None for v in by_source.values()):   # the coordinator's count: each item once
        items = sum(v or 0.0 for v in by_source.values())
        hits = (by_source["known"] or 0.0) + (by_source["cache_hit"] or 0.0)
    else:
        known = d.get("known_hits") or 0.0
        hits = known + (d.get("cache_hit") or 0.0)
        calls = d.get("encode_calls")
        items = known + calls if calls is not None else hits + (encoded or 0.0)
    return {"items": items, "hits": hits, "hit_ratio": hits / items if items else None, "encoded": encoded,
            "encoded_ratio": encoded / items if encoded is not None and items else None,
            "frame_groups": frame_groups(d), "counters": d}


def frame_groups(d: dict[str, float | None]) -> dict[str, float | None] | None:
    """Video frame groups encode looked up over the run: {groups, hits, hit_ratio}; None without encode's counters
    or videos."""
    hits, encoded = d.get("frame_groups_hit"), d.get("frame_groups_encoded")
    if hits is None and encoded is None:
        return None
    groups = (hits or 0.0) + (encoded or 0.0)
    return {"groups": groups, "hits": hits or 0.0, "hit_ratio": (hits or 0.0) / groups if groups else None}
