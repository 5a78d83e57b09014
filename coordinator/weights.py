"""Weight updates across the cluster without a restart, one version per request (POST /update_weights).

Every request runs every stage on one weight version.  `enter` tags a request with the version the cluster
serves when it starts (ctx.weight_version); every encode, prefill and decode call names it, each instance
refuses another (services/weights/role.py) and answers with the version that ran it, which `check` compares
(a mismatch fails the request: never a mixed answer).  An update (`update`):

1. stage: every healthy encode, prefill and decode instance checks the checkpoint and builds the new
   weights beside the served ones, in parallel, while the cluster keeps serving the old version; a bad
   checkpoint (InvalidRequest from any instance) discards what was staged everywhere: 400, nothing changed;
2. switch: new requests wait at the gate; requests of the old version finish on the old weights (up to
   --weight-update-drain-s, after which the stragglers are aborted); then every instance commits at once and
   the gate opens on the new version.  So no request ever sees two versions, and none fails;
3. the answer reports the time from the POST until every instance of each role served the new version.

An instance that was down during an update, or joins later (announce), is brought to the cluster's version
before it takes work (`sync`, the pools' admission hook); one that answers with another version is taken out
of rotation (clients.with_failover) and synced the same way.  At start the coordinator adopts the version the
instances serve (a restarted coordinator does not roll the weights back).  `reload` goes back to the base
weights (each instance's own --model), as version "base".
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from typing import Any

import grpc

from services.protocol.errors import Conflict, EpdError, InvalidRequest, Unavailable
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from . import inflight
from .clients import error_from_rpc
from .context import RequestContext
from .routing.pool import Instance, InstancePool

log = logging.getLogger(__name__)
BASE_VERSION = "base"
MODEL_ROLES = ("encode", "prefill", "decode")
STAGE_TIMEOUT_S = 900.0    # a large checkpoint on a busy machine: load, check, prepack
CALL_TIMEOUT_S = 30.0
ADOPT_TIMEOUT_S = 5.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def stub(instance: Instance) -> rpc.WeightsServiceStub:
    return rpc.WeightsServiceStub(instance.channel)


class WeightsController:
    def __init__(self, pools: list[InstancePool], drain_s: float, metrics: Any = None) -> None:
        self.pools = [pool for pool in pools if pool.role in MODEL_ROLES]
        self.drain_s, self.metrics = drain_s, metrics
        self.version, self.path = BASE_VERSION, ""
        self.used: set[str] = {BASE_VERSION}
        self.last: dict[str, Any] | None = None       # the last update's report
        self._open = asyncio.Event()                  # cleared while the switch runs: requests wait
        self._running: dict[str, set[inflight.InflightRequest]] = {}
        self._updating = asyncio.Lock()
        for pool in self.pools:
            pool.admit = self.sync

    # ---- requests -------------------------------------------------------------------------------

    async def enter(self, ctx: RequestContext) -> None:
        """Tag the request with the served version (waiting, within its first-token bound, while a switch runs);
        it counts as running on that version until it ends."""
        if not self._open.is_set():
            try:
                async with asyncio.timeout(ctx.time_left()):
                    await self._open.wait()
            except TimeoutError:
                ctx.time_left()   # raises the request's own ttft_timeout
        ctx.weight_version = self.version
        record = inflight.current_request.get()
        if record is not None:
            running = self._running.setdefault(self.version, set())
            running.add(record)
            record.on_close(lambda: running.discard(record))

    # ---- the update -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Adopt the version the instances serve (bounded), then let requests in."""
        try:
            async with asyncio.timeout(ADOPT_TIMEOUT_S):
                infos = await asyncio.gather(*(self._info(i) for pool in self.pools for i in pool.healthy()))
            seen = Counter((info.weight_version, info.path) for info in infos if info is not None)
            if seen:
                (self.version, self.path), _ = seen.most_common(1)[0]
                self.used.add(self.version)
        except TimeoutError:
            log.warning("weights: the instances did not say their weight version within %g s; serving %r",
                        ADOPT_TIMEOUT_S, self.version)
        finally:
            self._open.set()

    async def update(self, path: str, version: str | None = None) -> dict[str, Any]:
        if self._updating.locked():
            raise Conflict("a weight update is running; try again when it is done", code="weight_update_running")
        async with self._updating:
            name = self._name(version, path)
            return await self._update(path, name)

    async def _update(self, path: str, version: str) -> dict[str, Any]:
        posted = time.monotonic()
        targets = [(pool, i) for pool in self.pools for i in pool.healthy()]
        if not targets:
            raise Unavailable("no encode, prefill or decode instance is up to take the weights",
                              code="weight_update_unavailable")
        staged = await self._stage_all(targets, path, version)
        old = self.version
        self._open.clear()
        try:
            drained_s, aborted = await self._drain(old)
            committed = await self._commit_all(staged, version, posted)
            self.version, self.path = version, path
            self.used.add(version)
        finally:
            self._open.set()
        report = self._report(posted, old, path, version, staged, committed, drained_s, aborted)
        self.last = report
        log.info("weights: now serving %r (%s)", version, report["serving_after_s"])
        return report

    def _name(self, version: str | None, path: str) -> str:
        if version is None:
            numbers = [int(v) for v in self.used if v.isdigit()]
            return BASE_VERSION if not path else str(max(numbers, default=0) + 1)
        if not _NAME.match(version):
            raise InvalidRequest("weight_version must be 1-128 characters of letters, digits and ._:- (starting "
                                 "with a letter or digit)", code="invalid_weight_version")
        if version == self.version:
            raise Conflict(f"weight version {version!r} is being served already", code="weight_version_exists")
        if version in self.used and version != BASE_VERSION:
            raise Conflict(f"weight version {version!r} was used before: name new weights anew (a version names "
                           "one set of weights: caches are keyed by it)", code="weight_version_exists")
        if (version == BASE_VERSION) != (not path):
            raise InvalidRequest("'base' names the base weights (POST /reload_weights), and only them",
                                 code="invalid_weight_version")
        return version

    async def _stage_all(self, targets: list[tuple[InstancePool, Instance]], path: str,
                         version: str) -> list[tuple[InstancePool, Instance, pb.WeightsInfo]]:
        request = pb.StageRequest(weight_version=version, path=path)
        results = await asyncio.gather(*(self._call(i, "Stage", request, STAGE_TIMEOUT_S) for _, i in targets),
                                       return_exceptions=True)
        refused = next((r for r in results if isinstance(r, InvalidRequest)), None)
        staged = [(pool, i, r) for (pool, i), r in zip(targets, results, strict=True)
                  if isinstance(r, pb.WeightsInfo)]
        failed = [(pool, i, r) for (pool, i), r in zip(targets, results, strict=True)
                  if not isinstance(r, pb.WeightsInfo)]
        missing = {pool.role for pool, _ in targets} - {pool.role for pool, _, _ in staged}
        if refused is not None or missing:
            await self._discard(staged, version)
            if refused is not None:
                raise InvalidRequest(f"weights not updated: {refused.message}", code=refused.code)
            raise Unavailable(f"weights not updated: no {', '.join(sorted(missing))} instance could stage them "
                              f"({'; '.join(str(r) for _, _, r in failed)[:500]})", code="weight_update_failed")
        for pool, instance, error in failed:   # the rest go on: these are synced when they answer again
            pool.mark_down(instance, f"weight stage failed: {error}")
        return staged

    async def _discard(self, staged: list[tuple[InstancePool, Instance, pb.WeightsInfo]], version: str) -> None:
        request = pb.DiscardRequest(weight_version=version)
        await asyncio.gather(*(self._call(i, "Discard", request) for _, i, _ in staged), return_exceptions=True)

    async def _drain(self, old: str) -> tuple[float, int]:
        """Wait for the requests of version `old` to end (new ones wait at the gate); abort what is left after
        drain_s.  Returns (seconds waited, requests aborted)."""
        started = time.monotonic()
        running = self._running.get(old, set())
        while running and time.monotonic() - started < self.drain_s:
            await asyncio.sleep(0.01)
        aborted = sum(record.cancel("abort") for record in list(running))
        if aborted:
            log.warning("weights: %d requests of version %r still ran after %g s: aborted", aborted, old,
                        self.drain_s)
        while running and time.monotonic() - started < self.drain_s + CALL_TIMEOUT_S:
            await asyncio.sleep(0.01)   # the aborted ones close their calls
        return time.monotonic() - started, aborted

    async def _commit_all(self, staged: list[tuple[InstancePool, Instance, pb.WeightsInfo]], version: str,
                          posted: float) -> list[tuple[InstancePool, Instance, pb.WeightsInfo, float]]:
        request = pb.CommitRequest(weight_version=version)

        async def one(instance: Instance) -> tuple[pb.WeightsInfo, float]:
            info = await self._call(instance, "Commit", request)
            return info, time.monotonic() - posted

        results = await asyncio.gather(*(one(i) for _, i, _ in staged), return_exceptions=True)
        committed = []
        for (pool, instance, _), result in zip(staged, results, strict=True):
            if isinstance(result, BaseException):
                pool.mark_down(instance, f"weight commit failed: {result}")   # synced when it answers again
            else:
                committed.append((pool, instance, *result))
        return committed

    def _report(self, posted: float, old: str, path: str, version: str,
                staged: list[tuple[InstancePool, Instance, pb.WeightsInfo]],
                committed: list[tuple[InstancePool, Instance, pb.WeightsInfo, float]],
                drained_s: float, aborted: int) -> dict[str, Any]:
        roles = sorted({pool.role for pool, _, _, _ in committed})
        return {"weight_version": version, "previous": old, "path": path,
                "seconds": round(time.monotonic() - posted, 3), "drain_s": round(drained_s, 3),
                "aborted": aborted,
                "serving_after_s": {r: round(max(t for p, _, _, t in committed if p.role == r), 3) for r in roles},
                "stage_s": {r: round(max(s.stage_s for p, _, s in staged if p.role == r), 3) for r in roles},
                "instances": [{"role": p.role, "address": i.address, "stage_s": round(info.stage_s, 3),
                               "commit_s": round(info.commit_s, 3), "serving_after_s": round(t, 3)}
                              for p, i, info, t in committed]}

    # ---- instances that come (back) -------------------------------------------------------------

    async def sync(self, instance: Instance) -> bool:
        """Bring an instance to the served version before it takes work (a pool's admission hook)."""
        info = await self._info(instance)
        if info is None or info.weight_version == self.version:
            return True
        log.info("weights: %s %s serves %r, the cluster %r: loading it", instance.role, instance.address,
                 info.weight_version, self.version)
        try:
            await self._call(instance, "Stage", pb.StageRequest(weight_version=self.version, path=self.path),
                             STAGE_TIMEOUT_S)
            await self._call(instance, "Commit", pb.CommitRequest(weight_version=self.version))
        except EpdError as exc:
            log.warning("weights: %s %s could not load %r: %s", instance.role, instance.address, self.version,
                        exc.message)
            return False
        return True

    async def _info(self, instance: Instance) -> pb.WeightsInfo | None:
        """What the instance serves; None when it has no weights service (version-agnostic) or does not answer."""
        try:
            return await self._call(instance, "Info", pb.InfoRequest())
        except EpdError:
            return None

    async def _call(self, instance: Instance, method: str, request: Any,
                    timeout: float = CALL_TIMEOUT_S) -> pb.WeightsInfo:
        try:
            return await getattr(stub(instance), method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise Unavailable(f"{instance.address} has no weights service", code="no_weights_service") from None
            raise error_from_rpc(exc) from None

    def describe(self) -> dict[str, Any]:
        return {"weight_version": self.version, "path": self.path, "updating": self._updating.locked(),
                "last_update": self.last}
