"""Real in-process gRPC servers for the four roles, answering from a script: the pipeline's test bench.

Each servicer speaks the real epd gRPC contract (services/rpc/v1) through the same
`rpc_method` / `rpc_stream` wrappers the roles use, so errors travel exactly as a role
sends them (status + epd code in trailing metadata).  What they answer is scripted so
that faults a real cluster cannot produce on demand are reproducible: an EC entry gone
between encode and prefill (`ec_entry_missing`), a KV entry gone between prefill and
decode (`kv_entry_missing`), a decode instance that dies mid-stream (UNAVAILABLE with no
epd code: what a reset connection looks like).  These are fakes of roles, named as such;
tests/e2e runs the real ones.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry

from coordinator.cluster import Cluster
from coordinator.context import RequestContext
from coordinator.metrics import CoordinatorMetrics
from services.config import EpdConfig
from services.protocol.errors import NotFound
from services.rpc.handlers import rpc_method, rpc_stream
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc
from services.server import free_port

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
PIXELS = b"\x07" * 4096  # stands for a kwargs_data item


def rendered(num_images: int = 1) -> pb.RenderResponse:
    items = [pb.MultiModalItem(modality="image", mm_hash=f"h{i}", offset=1 + 2 * i, length=2,
                               kwargs_data=PIXELS, mm_metadata=b"grid") for i in range(num_images)]
    return pb.RenderResponse(request_id="r", token_ids=TOKENS, items=items, model="m",
                             sampling_params_json=json.dumps({"max_tokens": 3}).encode())


class Render(rpc.RenderServiceServicer):
    def __init__(self) -> None:
        self.num_images = 1
        self.calls = 0

    @rpc_method
    async def RenderChat(self, request: pb.RenderChatRequest, context: grpc.aio.ServicerContext):
        self.calls += 1
        return rendered(self.num_images)

    RenderCompletion = RenderChat


class Encode(rpc.EncodeServiceServicer):
    """`script`: "ok" or "mm_missing" per call; "ok" once it runs out."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.requests: list[pb.EncodeRequest] = []

    @rpc_method
    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        if (self.script.pop(0) if self.script else "ok") == "mm_missing":
            raise NotFound("mm entry is gone", code="mm_entry_missing")
        items = [pb.EncodedItem(mm_hash=i.mm_hash, handle_json=json.dumps({"n": len(self.requests)}).encode())
                 for i in request.items]
        return pb.EncodeResponse(request_id=request.request_id, items=items)


class Prefill(rpc.PrefillServiceServicer):
    """`script`: what each call does in turn ("ok" or "ec_missing"); "ok" once it runs out."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.requests: list[pb.PrefillRequest] = []

    @rpc_method
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        if (self.script.pop(0) if self.script else "ok") == "ec_missing":
            raise NotFound("EC entry h0 is gone", code="ec_entry_missing")
        kv = json.dumps({"handle": len(self.requests)}).encode()
        return pb.PrefillResponse(request_id=request.request_id, first_token_id=5, kv_transfer_params_json=kv,
                                  prompt_tokens=len(request.token_ids))


OUTPUT = [(5, "a", ""), (6, "b", ""), (7, "c", "length")]   # every decode call's answer: (token, text, finish)


class Decode(rpc.DecodeServiceServicer):
    """`script`: "ok", "kv_missing" or "die_mid_stream" (after two chunks) per call; "ok" once it runs out.  A
    resumed call (resumed_token_ids) goes on after the tokens it names, as a real decode does."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.requests: list[pb.DecodeRequest] = []
        self.cancelled = 0

    @rpc_stream
    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        self.requests.append(request)
        behaviour = self.script.pop(0) if self.script else "ok"
        if behaviour == "kv_missing":
            raise NotFound("KV entry is gone", code="kv_entry_missing")
        for sent, (token, text, finish) in enumerate(OUTPUT[len(request.resumed_token_ids):]):
            if behaviour == "die_mid_stream" and sent == 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")  # no epd code: transport
            yield pb.DecodeChunk(token_ids=[token], text=text, finish_reason=finish)


@dataclass
class Bench:
    """The four scripted roles on real ports and a started Cluster pointing at them."""

    render: Render = field(default_factory=Render)
    encode: Encode = field(default_factory=Encode)
    prefill: Prefill = field(default_factory=Prefill)
    decode: Decode = field(default_factory=Decode)
    servers: list[grpc.aio.Server] = field(default_factory=list)
    cluster: Cluster | None = None

    async def start(self, dead_decode_first: bool = False, decode_instances: int = 1, **config: object) -> Cluster:
        addresses: dict[str, str] = {}
        for role, servicer, add, count in (
                ("render", self.render, rpc.add_RenderServiceServicer_to_server, 1),
                ("encode", self.encode, rpc.add_EncodeServiceServicer_to_server, 1),
                ("prefill", self.prefill, rpc.add_PrefillServiceServicer_to_server, 1),
                ("decode", self.decode, rpc.add_DecodeServiceServicer_to_server, decode_instances)):
            for _ in range(count):   # several instances of a role answer from the one script
                server = grpc.aio.server()
                add(servicer, server)
                port = free_port()
                server.add_insecure_port(f"127.0.0.1:{port}")
                await server.start()
                self.servers.append(server)
                addresses[role] = ",".join(filter(None, (addresses.get(role), f"127.0.0.1:{port}")))
        if dead_decode_first:
            addresses["decode"] = f"127.0.0.1:{free_port()},{addresses['decode']}"
        urls = {f"{role}_urls": address for role, address in addresses.items()}
        metrics = CoordinatorMetrics(CollectorRegistry())
        self.cluster = Cluster(EpdConfig(**urls, **config), metrics)  # type: ignore[arg-type]
        self.cluster.start()
        return self.cluster

    async def stop(self) -> None:
        if self.cluster is not None:
            await self.cluster.close()
        for server in self.servers:
            await server.stop(None)


def chat_context(request_id: str = "r1") -> RequestContext:
    return RequestContext(request_id=request_id, deadline=time.monotonic() + 10, kind="chat", body=b"{}")
