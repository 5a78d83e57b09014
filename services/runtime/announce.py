"""A role instance announcing itself to the coordinator (POST /v1/instances), for pools that grow at run time.

With --coordinator-url set (the coordinator's admin API: --admin-host /
--admin-port, never its public port), a role process posts {role,
grpc_address, http_url}, with `Authorization: Bearer <first --admin-token>`
when a token is configured, at start and every ANNOUNCE_EVERY_S (so a coordinator that
restarted, or forgot the instance while it was down, learns it again; every
RETRY_EVERY_S while the coordinator cannot be reached, so an instance whose host
was cut off joins again within seconds of the network's return), and
sends DELETE /v1/instances when it stops, so no new work is routed to it.
The coordinator admits an announced instance only once its health probe
answers.  --advertise-host is the host the coordinator can reach (a pod IP);
it defaults to --host.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.config import EpdConfig
from services.edge.auth import parse_keys

log = logging.getLogger(__name__)
ANNOUNCE_EVERY_S = 10.0
RETRY_EVERY_S = 1.0
TIMEOUT_S = 2.0


def announcement(config: EpdConfig, role: str, grpc_port: int, http_port: int) -> dict[str, Any]:
    host = config.server.advertise_host or config.server.host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6 literal
    return {"role": role, "grpc_address": f"{host}:{grpc_port}", "http_url": f"http://{host}:{http_port}"}


def _send(url: str, method: str, body: dict[str, Any], token: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url.rstrip("/") + "/v1/instances", data=json.dumps(body).encode(),
                                     method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
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
        failing = False
        while True:
            try:
                await self._run(_send, self.url, "POST", self.body, self._token)
                if failing:
                    log.info("announced to %s again", self.url)
                failing = False
            except OSError as exc:
                if not failing:  # one line per outage, not one per attempt
                    log.warning("cannot announce to coordinator %s: %s", self.url, exc)
                failing = True
            await asyncio.sleep(RETRY_EVERY_S if failing else ANNOUNCE_EVERY_S)

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
