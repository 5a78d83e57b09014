"""Encoder-cache hit ratio per item, from the cluster's Prometheus counters.

epd counts items in two places: the coordinator skips items whose embedding
it knows is stored (`epd_coordinator_ec_known_hits_total`) and sends the rest
to encode (`epd_coordinator_encode_calls_total`, one per item); each encode
instance answers from its cache or encodes (`epd_encode_items_total{result=
"cache_hit"|"encoded"}`). Over a run (after - before):

    items     = known_hits + encode_calls        (every item of every request)
    hit ratio = (known_hits + cache_hit) / items

with items = known_hits + cache_hit + encoded when the coordinator's
counters were not given. `encoded_ratio` = encoded / items is the share of
items that really ran the vision tower (an encode call that joins an
in-flight encode of the same item is neither a cache hit nor encoded).
Counters are summed over all given URLs.
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
            "cache_hit": _value(samples, ENCODE_ITEMS, result="cache_hit")}


def delta(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, value in after.items():
        out[key] = None if value is None else value - (before.get(key) or 0.0)
    return out


def add_deltas(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if a.get(k) is None and b.get(k) is None else (a.get(k) or 0.0) + (b.get(k) or 0.0)
            for k in set(a) | set(b)}


def hit_ratio(d: dict[str, float | None]) -> dict[str, Any]:
    known = d.get("known_hits") or 0.0
    hits = known + (d.get("cache_hit") or 0.0)
    calls, encoded = d.get("encode_calls"), d.get("encoded")
    items = known + calls if calls is not None else hits + (encoded or 0.0)
    return {"items": items, "hits": hits, "hit_ratio": hits / items if items else None, "encoded": encoded,
            "encoded_ratio": encoded / items if encoded is not None and items else None, "counters": d}
