"""The redis backend: one Redis string per entry (format in redis_format), reachable from any host.

Key `<namespace>:<purpose>:<key>`.  put() streams the value from tensor memory
without joining it (one SET ... PX, plus APPENDs beyond 64 MiB) inside
MULTI/EXEC, so a reader never sees half a value and every write carries the
TTL; get() reads pipelined 4 MiB GETRANGEs plus
STRLEN in one MULTI/EXEC straight into the output buffer (redis_resp) and
verifies prefix, nonce, header, length and crc32.  This producer remembers
what it wrote (LRU) to stay under capacity_bytes and to delete it on close().
Connection problems surface as BackendUnavailable within the socket timeouts
(connect 2 s, operation 10 s); the pool re-dials after a server restart.
On a Redis Cluster (redis+cluster://, redis_nodes) each key goes to its slot's
node; a node that is down makes its entries typed misses and puts go to
another node (the handle names the key written).

Copies (StoreStats.bytes_copied counts user-space payload copies; socket I/O
is not a copy here): put() sends straight from tensor or array memory (0);
put_into() lets `fill` write into the one buffer that is then sent (1);
get() receives straight into the buffer its tensors view (0).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import redis

from services.connectors.base import (
    ConnectorError,
    EntryMissing,
    StoreConfig,
    StoreStats,
    TensorSpec,
    TensorStore,
    check_key,
)
from services.connectors.codec import Data, byte_view, bytes_at, crc_of, is_array, plan, plan_specs, tensor_at
from services.connectors.redis_format import (
    READ_CHUNK,
    RedisRef,
    encode_head,
    handle_from_head,
    head_length_of,
    make_handle,
    value_pieces,
)
from services.connectors.redis_nodes import NodeDown, open_nodes, retried
from services.connectors.redis_resp import Arg, RespError, RespSession, borrowed

if TYPE_CHECKING:
    import torch

_LOOKUP_BYTES = 4096
_RELEASE_LUA = ("if redis.call('GETRANGE', KEYS[1], 8, 15) == ARGV[1] then "
                "return redis.call('DEL', KEYS[1]) end return 0")


class RedisTensorStore(TensorStore):
    backend = "redis"

    def __init__(self, config: StoreConfig) -> None:
        assert config.redis_url is not None  # StoreConfig checks it
        self.config = config
        self._verify = config.verify_checksum is not False
        self._nodes = open_nodes(config.redis_url)
        self._written: OrderedDict[str, tuple[int, float]] = OrderedDict()  # redis key -> (bytes, expiry)
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._puts = self._evictions = self._copied = 0
        self._closed = False

    def redis_key(self, key: str) -> str:
        return f"{self.config.namespace}:{self.config.purpose}:{check_key(key)}"

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A host buffer for a payload: page-locked for a CUDA role (`pin_memory`), so its copies are DMA."""
        if not self.config.pin_memory:
            return np.empty(nbytes, np.uint8)
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def _host(self, t: Any) -> Any:
        if is_array(t) or t.device.type == "cpu":
            return t if is_array(t) else t.detach()
        if not self.config.pin_memory:
            return t.detach().cpu()
        import torch

        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach())   # device -> pinned host

    def put(self, key: str, tensors: dict[str, Data]) -> dict[str, Any]:
        cpu = {n: self._host(t) for n, t in tensors.items()}
        specs, length = plan(cpu)
        return self._send(key, specs, length, [byte_view(t) for t in cpu.values()])

    def put_into(self, key: str, specs: dict[str, TensorSpec],
                 fill: Callable[[dict[str, torch.Tensor]], None]) -> dict[str, Any]:
        """One copy: `fill` writes into the buffer whose bytes are then sent."""
        planned, length = plan_specs(specs)
        buf = self._buffer(length)   # pinned for a CUDA producer: its fill copies device -> pinned host
        fill({s.name: tensor_at(buf, s) for s in planned})
        handle = self._send(key, planned, length, [bytes_at(buf, s) for s in planned])
        with self._lock:
            self._copied += sum(s.nbytes for s in planned)
        return handle

    def _send(self, key: str, specs: list[Any], length: int, views: list[np.ndarray]) -> dict[str, Any]:
        rkey = self.redis_key(key)
        crc = crc_of(views) if self._verify else None
        nonce = os.urandom(8)
        head = encode_head(key, nonce, specs, length, crc)
        if len(head) + length > self.config.capacity_bytes:
            raise ConnectorError(f"entry {key!r} needs {len(head) + length} bytes, more than the store "
                                 f"capacity {self.config.capacity_bytes}; raise capacity_bytes")
        first, *rest = value_pieces(head, specs, views, length)
        ttl_ms = max(1, int(self.config.ttl_s * 1000))

        def write(_: int) -> str:
            placed = self._nodes.place(rkey)   # on a cluster whose node for rkey is down: another key's node
            commands: list[list[Arg]] = [["MULTI"], ["SET", placed, first, "PX", ttl_ms]]
            commands += [["APPEND", placed, piece] for piece in rest]
            commands.append(["EXEC"])
            self._nodes.call(placed, f"put {key!r}", lambda client: _run(client, commands, len(commands) - 2))
            return placed

        placed = retried(range(2), write)
        self._remember(placed, len(head) + length)
        return make_handle(key, placed, nonce, len(head), length, crc, specs)

    def _remember(self, rkey: str, nbytes: int) -> None:
        with self._lock:
            self._puts += 1
            self._forget(rkey)
            self._written[rkey] = (nbytes, time.monotonic() + self.config.ttl_s)
            self._bytes += nbytes
            self._drop_expired()
            victims = []
            while self._bytes > self.config.capacity_bytes and len(self._written) > 1:
                victims.append(next(iter(self._written)))
                self._forget(victims[-1])
            self._evictions += len(victims)
        if victims:
            self._nodes.delete(victims)

    def _forget(self, rkey: str) -> None:
        self._bytes -= self._written.pop(rkey, (0, 0.0))[0]

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for rkey in [k for k, (_, expiry) in self._written.items() if expiry <= now]:
            self._forget(rkey)

    def lookup(self, key: str) -> dict[str, Any] | None:
        def read(client: redis.Redis, rkey: str) -> tuple[bytes, int]:
            pipe = client.pipeline(transaction=True)
            pipe.getrange(rkey, 0, _LOOKUP_BYTES - 1)
            pipe.strlen(rkey)
            head, total = pipe.execute()
            if head_length_of(head) > len(head):  # many tensors: the header is longer than the first read
                head = client.getrange(rkey, 0, head_length_of(head) - 1)
            return head, total

        def attempt(_: int) -> tuple[str, bytes, int]:
            rkey = self._nodes.place(self.redis_key(key))   # where a put would have gone
            return (rkey, *self._nodes.call(rkey, f"lookup {key!r}", lambda client: read(client, rkey)))

        try:
            rkey, head, total = retried(range(2), attempt)
        except NodeDown:   # a cluster node that is down: its entries are misses
            rkey, head, total = self.redis_key(key), b"", 0
        handle = handle_from_head(key, rkey, head, total)
        with self._lock:
            if handle is None:
                self._misses += 1
            else:
                self._hits += 1
                if rkey in self._written:
                    self._written.move_to_end(rkey)
        return handle

    def get(self, handle: dict[str, Any]) -> dict[str, torch.Tensor]:
        ref = RedisRef.from_handle(handle)
        buf = self._buffer(ref.total)  # one owned buffer, received into; tensors are views into it
        ranges = [(a, min(a + READ_CHUNK, ref.total)) for a in range(0, ref.total, READ_CHUNK)]
        commands: list[list[Arg]] = [["MULTI"]]
        commands += [["GETRANGE", ref.rkey, a, b - 1] for a, b in ranges]
        commands += [["STRLEN", ref.rkey], ["EXEC"]]
        targets = [buf.data[a:b] for a, b in ranges]
        try:
            *lengths, stored = retried(range(2), lambda _: self._nodes.call(
                ref.rkey, f"get {ref.key!r}", lambda client: _run(client, commands, len(ranges) + 1, targets)))
        except NodeDown as exc:
            raise EntryMissing(f"entry {ref.key!r} is on a Redis Cluster node that is down ({exc})") from None
        if sum(lengths) != min(stored, ref.total):
            raise ConnectorError(f"redis returned a short read for {ref.key!r}")
        ref.verify(buf, stored, self._verify)
        return {s.name: tensor_at(buf, s, ref.head_length) for s in ref.specs}

    def delete(self, key: str) -> bool:
        rkey = self._nodes.place(self.redis_key(key))
        with self._lock:
            self._forget(rkey)
        try:
            return bool(self._nodes.call(rkey, f"delete {key!r}", lambda client: client.delete(rkey)))
        except NodeDown:
            return False

    def release(self, handle: dict[str, Any]) -> None:
        """Delete the entry if it is still the write the handle names (one-shot KV)."""
        ref = RedisRef.from_handle(handle)
        try:
            deleted = self._nodes.call(ref.rkey, f"release {ref.key!r}",
                                       lambda client: client.eval(_RELEASE_LUA, 1, ref.rkey, ref.nonce))
        except NodeDown:
            return   # gone with its node
        if deleted:
            with self._lock:
                self._forget(ref.rkey)

    def stats(self) -> StoreStats:
        with self._lock:
            self._drop_expired()
            return StoreStats(self._bytes, len(self._written), self.config.capacity_bytes, self._hits,
                              self._misses, self._evictions, self._puts, self._copied)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keys, self._written, self._bytes = list(self._written), OrderedDict(), 0
        try:
            self._nodes.delete(keys)
        except ConnectorError:
            pass  # best effort: Redis is down; the TTL removes the keys
        finally:
            self._nodes.close()


def _run(client: redis.Redis, commands: list[list[Arg]], queued: int,
         targets: list[memoryview] | None = None) -> list[Any]:
    """MULTI, the commands, EXEC on one pooled connection of `client`, raw (redis_resp): EXEC's replies."""
    with borrowed(client) as resp:
        resp.send(commands)
        return _transaction_result(resp, queued, targets)


def _transaction_result(resp: RespSession, queued: int, targets: list[memoryview] | None = None) -> list[Any]:
    """Read the replies of MULTI, `queued` commands and EXEC; raise the first error reply."""
    replies = [resp.reply() for _ in range(queued + 1)]
    result = resp.reply(targets=targets)
    for r in [*replies, *(result if isinstance(result, list) else [result])]:
        if isinstance(r, RespError):
            raise r
    if not isinstance(result, list):
        raise RespError(f"EXEC returned {result!r}")
    return result
