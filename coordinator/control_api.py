"""The coordinator's control routes: instance registration and request aborts.

- POST /v1/instances {"role", "grpc_address", "http_url"?}: an instance
  announces itself (again and again is fine: it refreshes).  It joins its
  role's pool down and is admitted by the next health probe (about 0.5 s),
  so an address that does not answer never receives work; once it fails its
  probes for --instance-forget-after-s it is forgotten.
- DELETE /v1/instances {"role", "grpc_address"}: leave now (graceful scale-in).
- GET /v1/instances: every instance with its health, live in-flight calls and
  source ("config" for flags, "registered").
- POST /update_weights {"path", "weight_version"?}: every encode, prefill and decode instance loads the
  Hugging Face checkpoint folder `path` (checked first: a bad path or another architecture is a 400 and
  nothing changes), then the cluster switches to it at once; requests that started on the old weights
  finish on them (coordinator/weights.py).  Answers the report: the new version and, per role, the seconds
  from the POST until every instance of it served the new version.
- POST /reload_weights: the same with the base weights (each instance's --model), as version "base".
- GET /weights: the version served now, its path, whether an update runs, the last update's report.
- POST /abort_requests {"request_ids": [...]}: cancel those running requests
  in every stage (vLLM's body; "chatcmpl-", "cmpl-" and "generate-tokens-"
  prefixes are accepted) -> {"aborted": n}.  Ids are labels (request_ids.py):
  with the admin token every request with that label, with a tenant's API
  key only the ones it sent.

These routes are served by the admin app (admin.py), never the public one.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.edge.auth import principal
from services.edge.http_api import endpoint, parse_body
from services.protocol.common import ProtocolModel
from services.protocol.errors import NotFound
from services.protocol.generate import AbortRequest

from .cluster import Cluster
from .inflight import InflightRegistry

_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253}):\d{1,5}$")
_HTTP_URL = re.compile(r"^https?://[^\s/]{1,260}$")
ID_PREFIXES = ("chatcmpl-", "cmpl-", "generate-tokens-")


class InstanceAnnouncement(ProtocolModel):
    """One role instance, as it announces itself."""

    role: Literal["render", "encode", "prefill", "decode"] = Field(description="The instance's role.")
    grpc_address: str = Field(description="host:port the coordinator calls over gRPC.")
    http_url: str | None = Field(default=None, description="http(s)://host:port of its HTTP API, if any.")

    @field_validator("grpc_address")
    @classmethod
    def _address(cls, value: str) -> str:
        port = value.rsplit(":", 1)[-1]
        if not _ADDRESS.match(value) or not 0 < int(port) < 65536:
            raise ValueError("must be host:port (port 1..65535)")
        return value

    @field_validator("http_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not _HTTP_URL.match(value.rstrip("/")):
            raise ValueError("must be http(s)://host:port")
        return None if value is None else value.rstrip("/")


class WeightUpdate(ProtocolModel):
    """POST /update_weights (prime-rl's body, plus an optional version name)."""

    path: str = Field(min_length=1, max_length=4096, description="A Hugging Face checkpoint folder every encode, "
                      "prefill and decode instance can read (a trainer's save_pretrained output).")
    weight_version: str | None = Field(default=None, description="The name answers will report; default: the next "
                                       "integer.  A name used before is refused: it names other weights.")


class InstanceRef(ProtocolModel):
    """Which instance to remove."""

    role: Literal["render", "encode", "prefill", "decode"] = Field(description="The instance's role.")
    grpc_address: str = Field(min_length=1, max_length=300, description="Its gRPC address, as announced.")


def plain_id(request_id: str) -> str:
    for prefix in ID_PREFIXES:
        if request_id.startswith(prefix):
            return request_id[len(prefix):]
    return request_id


class ControlApi:
    def __init__(self, cluster: Cluster, registry: InflightRegistry) -> None:
        self.cluster, self.registry = cluster, registry

    @endpoint
    async def announce(self, request: Request) -> Response:
        body = await parse_body(request, InstanceAnnouncement)
        instance = self.cluster.pool(body.role).add(body.grpc_address, body.http_url or "")
        return JSONResponse(instance.describe())

    @endpoint
    async def leave(self, request: Request) -> Response:
        body = await parse_body(request, InstanceRef)
        if not self.cluster.pool(body.role).remove(body.grpc_address, "left (DELETE /v1/instances)"):
            raise NotFound(f"no {body.role} instance at {body.grpc_address}", code="instance_not_found")
        return JSONResponse({"removed": True})

    @endpoint
    async def list_instances(self, _: Request) -> Response:
        data: list[dict[str, Any]] = [i.describe() for pool in self.cluster.pools for i in pool.instances]
        return JSONResponse({"object": "list", "data": data})

    @endpoint
    async def update_weights(self, request: Request) -> Response:
        body = await parse_body(request, WeightUpdate)
        return JSONResponse(await self.cluster.weights.update(body.path, body.weight_version))

    @endpoint
    async def reload_weights(self, request: Request) -> Response:
        return JSONResponse(await self.cluster.weights.update("", None))

    @endpoint
    async def weights(self, _: Request) -> Response:
        return JSONResponse(self.cluster.weights.describe())

    @endpoint
    async def abort(self, request: Request) -> Response:
        body = await parse_body(request, AbortRequest)
        ids = {rid for raw in body.request_ids for rid in (raw, plain_id(raw))}
        return JSONResponse({"aborted": self.registry.abort(sorted(ids), principal(request.scope))})

    def routes(self) -> list[Route]:
        return [Route("/v1/instances", self.announce, methods=["POST"]),
                Route("/v1/instances", self.leave, methods=["DELETE"]),
                Route("/v1/instances", self.list_instances, methods=["GET"]),
                Route("/update_weights", self.update_weights, methods=["POST"]),
                Route("/reload_weights", self.reload_weights, methods=["POST"]),
                Route("/weights", self.weights, methods=["GET"]),
                Route("/abort_requests", self.abort, methods=["POST"])]
