"""n samples of one prompt share its KV blocks: forked by reference, the last partial block copied on write.

A request for n samples (`sampling_params.n`) loads its prompt's KV once, into one reservation
(`RequestBlocks.load`: the one copy of the hand-off), then `fork` turns it into n `ForkedBlocks`, one
per sample.  Every sample's block table starts with the same prompt blocks (a `SharedPrefix` owns
them, with a count of the samples still reading them); a sample's own blocks follow, taken from its
own reservation as its tokens land.  The prompt's last block is full of prompt tokens only when the
prompt length is a multiple of the block size; otherwise the first token a sample writes goes into
that shared, partial block, so the sample takes a copy of it first (copy on write), unless it is the
last sample still sharing it, which then takes the block over without a copy.  So the memory held is
the prompt once, plus per sample its generated tokens and at most one copied partial block.

Reservation (the pool's promise, block_pool.py): `group_blocks` is what a group of n reserves up front:
the prompt's blocks once, and per sample the blocks its tokens may need beyond the prompt's full ones
(its copy of the partial block included), so no sample ever runs dry mid-decode.  Whatever a sample
does not use goes back when it ends; the shared blocks go back when the last sample ends.
"""

from __future__ import annotations

import threading

from services.decode.block_pool import BlockPool
from services.decode.request_blocks import RequestBlocks


def sample_blocks(pool: BlockPool, prompt_len: int, max_tokens: int) -> int:
    """Blocks one sample may hold beyond the prompt's full blocks (its partial-block copy included)."""
    return pool.blocks_for(prompt_len + max_tokens - 1) - prompt_len // pool.block_size


def group_blocks(pool: BlockPool, prompt_len: int, max_tokens: int, n: int) -> int:
    """What a group of n samples reserves: the prompt's blocks once and each sample's own share."""
    return pool.blocks_for(prompt_len) + n * sample_blocks(pool, prompt_len, max_tokens)


def carve(parent: RequestBlocks, n: int, prompt_len: int, max_tokens: int) -> list[ForkedBlocks]:
    """The n samples' own reservations, taken out of the group's (`parent` keeps the prompt's share)."""
    share = sample_blocks(parent.pool, prompt_len, max_tokens)
    with parent._lock:
        if parent._reserved < n * share + parent.pool.blocks_for(prompt_len):
            raise ValueError(f"a reservation of {parent._reserved} blocks cannot hold {n} samples")
        parent._reserved -= n * share
    return [ForkedBlocks(parent.pool, share) for _ in range(n)]


class SharedPrefix:
    """The prompt's blocks, shared by the samples still reading them (the count), freed by the last."""

    def __init__(self, pool: BlockPool, blocks: list[int], num_tokens: int, readers: int) -> None:
        self.pool, self.num_tokens = pool, num_tokens
        self.full = blocks[:num_tokens // pool.block_size]             # whole blocks of prompt tokens
        self.tail = blocks[len(self.full)] if len(blocks) > len(self.full) else None   # the partial one
        self.tail_tokens = num_tokens - len(self.full) * pool.block_size
        self.readers = readers          # samples holding the full blocks
        self.tail_readers = readers if self.tail is not None else 0   # samples still reading the shared tail
        self._lock = threading.Lock()

    def take_tail(self) -> tuple[int, bool]:
        """A sample is about to write into the shared tail: (its block, whether it is a fresh copy)."""
        with self._lock:
            assert self.tail is not None and self.tail_readers > 0
            self.tail_readers -= 1
            if self.tail_readers == 0:   # the last reader takes the block over: no copy
                tail, self.tail = self.tail, None
                return tail, False
            tail = self.tail
        return tail, True

    def leave(self, reads_tail: bool) -> None:
        """A sample ended; the last reader of a part gives that part back to the pool."""
        freed: list[int] = []
        tokens = 0
        with self._lock:
            if reads_tail:
                self.tail_readers -= 1
                if self.tail_readers == 0 and self.tail is not None:
                    freed.append(self.tail)
                    tokens += self.tail_tokens
                    self.tail = None
            self.readers -= 1
            if self.readers == 0:
                freed = self.full + freed
                tokens += len(self.full) * self.pool.block_size
                self.full = []
        if freed:
            self.pool.give_back(freed, 0, tokens)


class ForkedBlocks(RequestBlocks):
    """One sample's block table: the shared prompt blocks, then its own; `release` leaves the prefix."""

    def __init__(self, pool: BlockPool, reserved: int) -> None:
        super().__init__(pool, reserved)
        self.prefix: SharedPrefix | None = None
        self.reads_tail = False

    def attach(self, prefix: SharedPrefix) -> None:
        """Point this sample at the prompt's shared blocks (`fork` does it for each live sample)."""
        self.prefix = prefix
        self.reads_tail = prefix.tail is not None
        self.blocks = list(prefix.full) + ([prefix.tail] if prefix.tail is not None else [])
        self.num_tokens = prefix.num_tokens

    def append_slot(self) -> tuple[int, int, bool]:
        if self.reads_tail and self.num_tokens % self.pool.block_size:
            self._own_tail()
            block, offset, _ = super().append_slot()
            return block, offset, True   # the table's last entry changed: the runner rewrites it
        return super().append_slot()

    def _own_tail(self) -> None:
        assert self.prefix is not None
        shared, fresh = self.prefix.take_tail()
        self.reads_tail = False
        if not fresh:
            return   # this sample took the block over (the last reader): it is its own now
        with self._lock:
            [copy] = self.pool.take(1)
            self._reserved -= 1
            self.blocks[-1] = copy
        self.pool.kv[:, :, copy] = self.pool.kv[:, :, shared]
        self.pool.count_tokens(self.prefix.tail_tokens)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            prefix, shared = self.prefix, 0
            if prefix is not None:
                shared = len(prefix.full) + (1 if self.reads_tail else 0)
            own, reserved, self.blocks, self._reserved = self.blocks[shared:], self._reserved, [], 0
        held = self.num_tokens - (prefix.num_tokens if prefix is not None else 0)
        if prefix is not None and not self.reads_tail:
            held += prefix.tail_tokens   # its own tail (a copy or the block it took over) holds prompt tokens
        self.pool.give_back(own, reserved, held)
        if prefix is not None:
            prefix.leave(self.reads_tail)


def fork(parent: RequestBlocks, members: list[ForkedBlocks]) -> None:
    """Hand the prompt `parent` loaded to `members` (the live samples); `parent` is spent afterwards (its
    blocks belong to the shared prefix, what is left of its reservation goes back to the pool)."""
    with parent._lock:
        blocks, reserved = parent.blocks, parent._reserved
        parent.blocks, parent._reserved, parent._released = [], 0, True
    if not members:
        parent.pool.give_back(blocks, reserved, parent.num_tokens)
        return
    if reserved:
        parent.pool.give_back([], reserved, 0)
    prefix = SharedPrefix(parent.pool, blocks, parent.num_tokens, len(members))
    for member in members:
        member.attach(prefix)
