"""The E:P:D ratio the capacity model recommends, from the stage costs the coordinator measures as it runs.

docs/capacity.md's model: per second of traffic, encode needs λ·k·E instance-seconds, prefill λ·P, and decode
holds λ·O·D rows (a request holds a row for its O steps); instances = load / ρ for encode and prefill, rows /
(ρ · slots) for decode, ρ the target utilisation.  The coordinator sees these loads directly: by Little's law the
average number of its calls in flight to a role *is* that role's arrival rate times its time per call — encode
calls are one per item (λ·k·E), prefill calls one per request (λ·P), decode streams are rows (λ·O·D).  Each pool
integrates its calls in flight over time exactly (`InstancePool.call_seconds`: every call's duration, summed);
every SAMPLE_S the tracker reads it, and over the last WINDOW_S (load = call-seconds / seconds):

    recommended instances: encode = L_encode / ρ, prefill = L_prefill / ρ, decode = L_decode / (ρ · slots)

with slots = --decode-slots.  As in the model, batching gains (items or prompts of concurrent requests sharing a
forward) are left out, so encode and prefill are planned on the safe side.  Published as
`epd_coordinator_recommended_instances{role}` and `epd_coordinator_recommended_ratio{role}` (instances over the
smallest one's) and under "capacity" in GET /cluster, next to the instances each role has now.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

ROLES = ("encode", "prefill", "decode")
SAMPLE_S = 0.5
WINDOW_S = 60.0
UTILISATION = 0.7   # ρ: at 70% a queue waits about 1.2 service times on average (docs/capacity.md)


class CapacityTracker:
    def __init__(self, pools: dict[str, Any], decode_slots: int, metrics: Any = None,
                 window_s: float = WINDOW_S) -> None:
        self.pools, self.decode_slots, self.metrics = pools, decode_slots, metrics
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[str, float]]] = deque()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_S)

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, {r: self.pools[r].call_seconds() for r in ROLES}))
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()
        if self.metrics is not None:
            plan = self.plan()
            for role in ROLES:
                self.metrics.recommended_instances.labels(role).set(plan["recommended_instances"][role])
                self.metrics.recommended_ratio.labels(role).set(plan["ratio"][role])

    def load(self) -> dict[str, float]:
        """Average calls in flight per role over the window (instance-seconds per second; decode: rows)."""
        if len(self._samples) < 2:
            return dict.fromkeys(ROLES, 0.0)
        (start, first), (end, last) = self._samples[0], self._samples[-1]
        return {r: (last[r] - first[r]) / (end - start) for r in ROLES}

    def plan(self) -> dict[str, Any]:
        load = self.load()
        wanted = {"encode": load["encode"] / UTILISATION, "prefill": load["prefill"] / UTILISATION,
                  "decode": load["decode"] / (UTILISATION * self.decode_slots)}
        smallest = min((v for v in wanted.values() if v > 0), default=0.0)
        ratio = {r: (v / smallest if smallest else 0.0) for r, v in wanted.items()}
        span = self._samples[-1][0] - self._samples[0][0] if len(self._samples) > 1 else 0.0
        return {"window_s": round(span, 1), "utilisation": UTILISATION, "decode_slots": self.decode_slots,
                "load": {r: round(v, 3) for r, v in load.items()},
                "recommended_instances": {r: round(v, 3) for r, v in wanted.items()},
                "ratio": {r: round(v, 2) for r, v in ratio.items()},
                "ratio_text": ":".join(f"{ratio[r]:.1f}" for r in ROLES) if smallest else "no load yet",
                "instances": {r: len(self.pools[r].healthy()) for r in ROLES}}
