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

from services.decode.params import sample_params
from services.decode.request import DecodeRequest
from services.decode.request_blocks import RequestBlocks
from services.decode.stream import DecodeStream

__all__ = ["SampleGroup", "sample_params"]


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
