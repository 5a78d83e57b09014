"""A request for n samples inside the decode engine: n `DecodeRequest`s on one stream and one loaded prompt.

`DecodeEngine.open_samples` builds it: the group's reservation (fork.group_blocks) is carved into
one per sample (fork.carve), each sample's first token (prefill sampled one per sample) is judged
and emitted at once, and the caller loads the prompt's KV into `blocks` once, as for one sample.
`DecodeEngine.start` then forks those blocks to the samples still running (fork.fork: shared by
reference, the partial last block copied on write) and queues them for steps; each sample takes a
row of its own and ends on its own, and the stream ends with the last one.

Seeds (vLLM's rule, vllm/v1/engine/parallel_sampling.py): sample i of a seeded request draws with
seed + i, so each sample's draws stay a pure function of (its seed, its output index): the same
request gives the same n samples whatever else shares the batch, and a sample resumed on its own
(coordinator/pipeline.py) goes on exactly as it would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from services.decode.fork import ForkedBlocks, carve, fork
from services.decode.request import DecodeRequest
from services.decode.request_blocks import RequestBlocks
from services.decode.stream import DecodeStream
from services.generation.detokenizer import IncrementalDetokenizer
from services.generation.params import DecodeParams, sample_params
from services.protocol.errors import InvalidRequest

__all__ = ["SampleGroup", "SampleGroups", "sample_params"]


class SampleGroup:
    """The n samples of one request: what the serving core loads, starts and reads, like one request."""

    def __init__(self, request_id: str, blocks: RequestBlocks, members: list[DecodeRequest],
                 stream: DecodeStream, prompt_len: int) -> None:
        self.request_id, self.blocks, self.members = request_id, blocks, members
        self.stream, self.prompt_len = stream, prompt_len
        self.started = False

    @property
    def finished(self) -> bool:
        return all(member.finished for member in self.members)

    @property
    def live(self) -> list[DecodeRequest]:
        return [member for member in self.members if not member.finished]


class SampleGroups:
    """The decode engine's requests for n samples (mixed into DecodeEngine: its lock, registry and emit)."""

    if TYPE_CHECKING:   # DecodeEngine's, used here
        _cond: Any
        _requests: dict[str, DecodeRequest]
        _groups: dict[str, SampleGroup]
        lm: Any
        tokenizer: Any
        stream_timeout: float | None
        _decoders: dict[bool, Any]

        def _max_tokens(self, prompt_len: int, params: DecodeParams) -> int: ...
        def _check_accept(self, request_id: str, samples: int = 1) -> None: ...
        def _emit_token(self, request: DecodeRequest, token: int) -> Any: ...
        def start(self, request: Any) -> None: ...
        def fail(self, request: Any, message: str) -> None: ...

    def open_samples(self, request_id: str, blocks: RequestBlocks, prompt_len: int, rope_delta: int,
                     first_tokens: Sequence[int], params: DecodeParams,
                     prompt_token_ids: Sequence[int] | None = None) -> SampleGroup:
        """`open` for a request of n = len(first_tokens) samples (services/decode/samples.py): `blocks` is the
        group's reservation (`reserve(..., samples=n)`), loaded once by the caller before `start`; sample i
        begins with first_tokens[i] and draws with seed + i."""
        members: list[DecodeRequest] = []
        try:
            max_tokens = self._max_tokens(prompt_len, params)
            own = carve(blocks, len(first_tokens), prompt_len, max_tokens)
            stream = DecodeStream(request_id, self.stream_timeout, samples=len(first_tokens))
            for index, (share, token) in enumerate(zip(own, first_tokens, strict=True)):
                members.append(self._member(request_id, share, prompt_len, rope_delta, token,
                                            sample_params(params, index), max_tokens, stream, prompt_token_ids,
                                            index, len(first_tokens)))
            group = SampleGroup(request_id, blocks, members, stream, prompt_len)
            with self._cond:
                self._check_accept(request_id, len(members))
                self._requests.update((member.key, member) for member in members)
                self._groups[request_id] = group
        except BaseException:
            blocks.release()
            for member in members:
                member.blocks.release()
            raise
        with self._cond:   # as `open`: the first tokens are judged and emitted here, on the caller's thread
            for member in members:
                self._emit_token(member, member.first_token)
        return group

    def _member(self, request_id: str, blocks: RequestBlocks, prompt_len: int, rope_delta: int, first_token: int,
                params: DecodeParams, max_tokens: int, stream: DecodeStream,
                prompt_token_ids: Sequence[int] | None, index: int, samples: int) -> DecodeRequest:
        if not 0 <= first_token < self.lm.vocab_size:
            raise InvalidRequest(f"first token {first_token} of sample {index} is outside the vocabulary")
        detokenizer = IncrementalDetokenizer(self.tokenizer, decode=self._decoders[params.skip_special_tokens])
        return DecodeRequest(request_id, blocks, prompt_len, int(rope_delta), first_token, params, max_tokens,
                             self.lm.eos_token_ids, detokenizer, stream, None, prompt_token_ids, index, samples)

    def _start_samples(self, group: SampleGroup) -> None:
        if not group.finished and group.blocks.num_tokens != group.prompt_len:
            self.fail(group, f"the loaded KV holds {group.blocks.num_tokens} tokens, prompt_len is {group.prompt_len}")
            return
        live = group.live   # the others ended on their first token; nothing else ends a sample before start
        fork(group.blocks, [cast(ForkedBlocks, member.blocks) for member in live])
        group.started = True
        for member in live:
            self.start(member)
