"""A prompt on its way through the prefill engine, and the result that holds its KV blocks.

`PrefillJob` is the engine's per-prompt state: the request, its prepared inputs, its blocks
(prefix-cache hits first, then its own), how many of its tokens have KV in the pool, and
the future its caller waits on.

`HeldPrefill` is what a finished prompt resolves to: the first-token logits (or, for a plain
greedy prompt, its token: the LM head screen's pick, services/models/head_screen.py, or the argmax) and position
state, plus a *lease* on the prompt's blocks.  A job's `on_finish` runs on the engine
thread right after the prompt's last forward, before its future resolves: the serving
layer puts the KV into the store there (no thread hand-off between the forward and the
put) and releases the blocks.  `fill(views)` copies the KV out of the blocks
into a destination in the wire layout (the KV store's own memory via `put_into`: the
hand-off's one copy); `release()` gives the blocks back (full ones stay in the prefix cache).
A held result must be released, once; it is a context manager for that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.connectors.base import ConnectorError
from services.models.base import MultiModalInput, PrefillInputs

if TYPE_CHECKING:
    import torch

    from services.prefill.kv_pool import KVPool

KV_NAME = "kv"


@dataclass
class PrefillJob:
    token_ids: list[int]
    items: list[MultiModalInput]
    cache_salt: str | None
    future: Future = field(default_factory=Future)
    inputs: PrefillInputs | None = None
    keys: list[bytes] = field(default_factory=list)  # prefix keys of the prompt's full blocks
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0    # leading tokens whose KV came from the prefix cache
    num_done: int = 0      # leading tokens whose KV is in the pool (cached included)
    on_finish: Callable[[HeldPrefill], None] | None = None  # run on the engine thread before the future resolves
    greedy: bool = False   # its first token is a plain greedy pick, decided on the engine thread
    draws: tuple[Any, ...] = ()   # DecodeParams of each sample's first token, drawn through the LM head screen
    prompt_logprobs: int | None = None   # top n per prompt token, when asked (services/prefill/prompt_logprobs.py)
    logprobs_mode: str = "raw_logprobs"  # logits or logprobs in those records
    prompt_records: list[Any] = field(default_factory=list)   # one per prompt token but the first, as rows run
    hands_off: bool = False   # its first token goes on to decode (compute_lease.py: decode's turn)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_remaining(self) -> int:
        return self.num_tokens - self.num_done


class HeldPrefill:
    """A finished prompt: logits, positions, and its KV blocks until `release()`."""

    def __init__(self, job: PrefillJob, first_logits: torch.Tensor | None, pool: KVPool,
                 release: Callable[[list[int]], None], first_tokens: list[int] | None = None) -> None:
        assert job.inputs is not None and (first_logits is None) != (first_tokens is None)
        self.first_logits = first_logits            # [vocab] float32, or None when the tokens were picked here
        # the greedy token (screen or argmax) when job.greedy; each sample's drawn token when job.draws
        self.first_tokens = first_tokens
        self.rope_delta = job.inputs.rope_delta
        self.prompt_records = job.prompt_records if job.prompt_logprobs is not None else None
        self.num_prompt_tokens = job.num_tokens
        self.num_cached_tokens = job.num_cached
        self._pool, self._blocks, self._release = pool, job.blocks, release
        self._lock = threading.Lock()
        self._released = False
        # What the job's `on_finish` left here (the serving layer's KV put, on the engine thread).
        self.kv_handle: dict[str, Any] | None = None
        self.kv_error: ConnectorError | None = None

    @property
    def blocks(self) -> tuple[int, ...]:
        """Pool blocks holding the prompt's KV in order (prefix-cache hits shared with other prompts first)."""
        return tuple(self._blocks)

    def kv_spec(self) -> dict[str, tuple[Any, ...]]:
        """{"kv": (dtype, [num_layers, 2, num_kv_heads, L, head_dim], device)}: what `fill` writes, from where
        (a CUDA pool's KV goes to the store as a CUDA tensor: services/connectors/base.py TensorSpec)."""
        layout = self._pool.layout
        shape = (layout.num_layers, 2, layout.num_kv_heads, self.num_prompt_tokens, layout.head_dim)
        return {KV_NAME: (layout.dtype, shape, str(self._pool.data.device))}

    def fill(self, views: dict[str, torch.Tensor]) -> None:
        """Copy the prompt's KV into `views["kv"]` (wire layout): the one copy out of the blocks."""
        with self._lock:
            if self._released:
                raise RuntimeError("the prefill's KV blocks were already released")
            slots = self._pool.slots(self._blocks, 0, self.num_prompt_tokens)
            self._pool.copy_out(slots, views[KV_NAME])

    def kv(self) -> torch.Tensor:
        """A tensor of its own holding the KV (tests, callers without a store)."""
        import torch

        [(dtype, shape, device)] = self.kv_spec().values()
        out = torch.empty(shape, dtype=dtype, device=device)
        self.fill({KV_NAME: out})
        return out

    def release(self) -> None:
        """Give the blocks back; idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release(self._blocks)

    def __enter__(self) -> HeldPrefill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def release_when_done(future: Future) -> None:
    """For a caller that stops waiting: whenever the job finishes, its blocks go back."""
    def done(finished: Future) -> None:
        if not finished.cancelled() and finished.exception() is None:
            finished.result().release()

    if not future.cancel():
        future.add_done_callback(done)
