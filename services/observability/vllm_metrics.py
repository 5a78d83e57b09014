"""The load gauges llm-d's scheduler scrapes, under vLLM's names, types, help texts and labels.

llm-d's endpoint picker reads `vllm:num_requests_waiting`, `vllm:num_requests_running` and
`vllm:kv_cache_usage_perc` from each pod's /metrics.  vLLM 0.32 exports them as gauges labelled
`model_name` (the served model name) and `engine` ("0" for a single-engine server); every epd role
that llm-d scrapes exports the same three, read from its own engine at scrape time (`ROLE_READS`):

- decode: running = requests holding a batch row; waiting = requests whose KV is in the pool waiting
  for a row, plus those waiting for KV room; usage = (used + reserved blocks) / pool blocks;
- prefill: running = prompts holding KV blocks (being prefilled); waiting = admitted prompts not yet
  holding blocks; usage = 1 - allocatable blocks / pool blocks (unreferenced prefix-cache blocks count
  as free, as vLLM counts them);
- encode: running = admitted images not waiting for the tower; waiting = images waiting for the tower;
  usage = 0 (an encoder holds no KV cache).

The collector holds its owner weakly, like services.observability.owned_metrics: the series go when the owner does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from services.observability.owned_metrics import OwnedCollector, read_safely

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"
HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
Reads = dict[str, Callable[[Any], float]]


def _decode_reads() -> Reads:
    def usage(s: Any) -> float:
        kv = s.engine.stats().kv
        return (kv.used_blocks + kv.reserved_blocks) / kv.num_blocks

    return {"vllm:num_requests_running": lambda s: s.engine.stats().active,
            "vllm:num_requests_waiting": lambda s: s.engine.stats().queued + s.num_waiting_for_kv,
            "vllm:kv_cache_usage_perc": usage}


def _prefill_reads() -> Reads:
    def usage(s: Any) -> float:
        blocks = s.engine.blocks
        return 1.0 - blocks.num_free / blocks.num_blocks

    return {"vllm:num_requests_running": lambda s: s.engine.num_running,
            "vllm:num_requests_waiting": lambda s: max(0, s.admission.inside - s.engine.num_running),
            "vllm:kv_cache_usage_perc": usage}


def _encode_reads() -> Reads:
    return {"vllm:num_requests_running": lambda s: max(0, s.admission.inside - s.engine.num_pending),
            "vllm:num_requests_waiting": lambda s: s.engine.num_pending,
            "vllm:kv_cache_usage_perc": lambda s: 0.0}


ROLE_READS: dict[str, Callable[[], Reads]] = {"decode": _decode_reads, "prefill": _prefill_reads,
                                              "encode": _encode_reads}


class VllmGauges(OwnedCollector):
    """vLLM's three load gauges over one role core (EncodeService, PrefillService, DecodeService)."""

    def __init__(self, owner: Any, role: str, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        self._reads = ROLE_READS[role]()
        self.model_name = model_name
        super().__init__(owner, registry)   # claims no names: a test process may build several owners

    def collect(self) -> Iterator[Metric]:
        owner = self._owner()
        if owner is None:
            return
        for name, read in self._reads.items():
            family = GaugeMetricFamily(name, HELP[name], labels=LABELS)
            family.add_metric([self.model_name, ENGINE_INDEX], read_safely(read, owner))
            yield family
