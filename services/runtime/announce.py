"""A role instance announcing itself to the coordinator (POST /v1/instances), for pools that grow at run time.

With --coordinator-url set (the coordinator's admin API: --admin-host /
--admin-port, never its public port), a role process posts {role,
grpc_address, http_url}, with `Authorization: Bearer <first --admin-token>`
when a token is configured:

- at start, and every ANNOUNCE_EVERY_S (a coordinator that restarted learns it again);
- every UNSEEN_S while no coordinator health probe has reached it for UNSEEN_S
  (the coordinator probes every 0.2 s): a coordinator that forgot the instance
  while its host was cut off probes it no more, and it must join again within
  about a second of the network's return, not at its next periodic announce;
- every RETRY_EVERY_S, each try bounded by RETRY_TIMEOUT_S, while the POST
  fails (a POST sent while the host was cut off hangs on its dropped SYN);

and sends DELETE /v1/instances when it stops, so no new work is routed to it.
The coordinator admits an announced instance only once its health probe
answers.  --advertise-host is the host the coordinator can reach (a pod IP);
it defaults to --host.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.config import EpdConfig
from services.edge.auth import parse_keys

log = logging.getLogger(__name__)
ANNOUNCE_EVERY_S = 10.0
RETRY_EVERY_S = 0.25
TIMEOUT_S = 2.0
RETRY_TIMEOUT_S = 1.0   # the coordinator answers a POST in milliseconds; under a second once the route is back
UNSEEN_S = 1.0          # five of the coordinator's probe intervals without a probe: announce again
_last_probe = float("-inf")


def probed() -> None:
    """A health probe reached this process (the gRPC health servicer calls it on every Check)."""
    global _last_probe
    _last_probe = time.monotonic()


def announcement(config: EpdConfig, role: str, grpc_port: int, http_port: int) -> dict[str, Any]:
    host = config.server.advertise_host or config.server.host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6 literal
    return {"role": role, "grpc_address": f"{host}:{grpc_port}", "http_url": f"http://{host}:{http_port}"}


def _send(url: str, method: str, body: dict[str, Any], token: str | None = None, timeout: float = TIMEOUT_S) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url.rstrip("/") + "/v1/instances", data=json.dumps(body).encode(),
                                     method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return int(reply.status)


class Announcer:
    def __init__(self, coordinator_url: str, body: dict[str, Any], token: str | None = None) -> None:
        self.url, self.body, self._token = coordinator_url, body, token
        self._task: asyncio.Task | None = None
        # Its own thread: a POST hanging on an unreachable coordinator never waits behind the role's work in the
        # loop's default executor, nor holds one of its threads.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="announce")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        failing, posted = False, float("-inf")
        while True:
            now = time.monotonic()
            unseen = now - _last_probe > UNSEEN_S and now - posted > UNSEEN_S
            if failing or unseen or now - posted >= ANNOUNCE_EVERY_S:
                try:
                    await self._run(_send, self.url, "POST", self.body, self._token,
                                    RETRY_TIMEOUT_S if failing or unseen else TIMEOUT_S)
                    if failing:
                        log.info("announced to %s again", self.url)
                    failing, posted = False, time.monotonic()
                except OSError as exc:
                    if not failing:  # one line per outage, not one per attempt
                        log.warning("cannot announce to coordinator %s: %s", self.url, exc)
                    failing = True
            await asyncio.sleep(RETRY_EVERY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            ref = {"role": self.body["role"], "grpc_address": self.body["grpc_address"]}
            await self._run(_send, self.url, "DELETE", ref, self._token)
        except OSError:
            pass  # the coordinator forgets us once our probes fail
        finally:
            self._thread.shutdown(wait=False)

    async def _run(self, *call: Any) -> int:
        return await asyncio.get_running_loop().run_in_executor(self._thread, *call)


def start_announcing(config: EpdConfig, role: str, grpc_port: int, http_port: int) -> Announcer | None:
    if not config.server.coordinator_url:
        return None
    tokens = parse_keys(config.security.admin_token)
    announcer = Announcer(config.server.coordinator_url, announcement(config, role, grpc_port, http_port),
                          tokens[0] if tokens else None)
    announcer.start()
    return announcer
