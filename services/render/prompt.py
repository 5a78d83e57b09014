"""`RenderedPrompt`: what render produces for one generation, before any transport.

It holds the items as in-memory arrays (cheap for the gRPC servicer, which sends
raw msgpack per item) and turns into the wire `GenerateRequest` on demand
(base64 items for JSON): the render endpoints answer with
`prompt.to_generate_request()` and a client posts it unchanged to
/inference/v1/generate ("zero client conversion").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.protocol.features import MultiModalFeatures
from services.protocol.generate import GenerateRequest, StreamOptions
from services.protocol.sampling import SamplingParams
from services.render.features import RenderedItem, to_features


@dataclass
class RenderedPrompt:
    request_id: str
    token_ids: list[int]
    items: list[RenderedItem]
    sampling_params: SamplingParams
    model: str
    cache_salt: str | None = None
    prompt: str | None = None              # the templated text, for debugging; None for token prompts
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict | None = field(default=None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mm_hashes(self) -> list[str]:
        return [item.mm_hash for item in self.items]

    def features(self, *, include_kwargs: bool = True,
                 include_metadata: bool = True) -> MultiModalFeatures | None:
        """The wire features; None for a text-only prompt.  Serializing pixels costs time: call once."""
        return to_features(self.items, include_kwargs=include_kwargs, include_metadata=include_metadata)

    def to_generate_request(self, *, include_kwargs: bool = True, include_metadata: bool = True,
                            ec_transfer_params: dict | None = None) -> GenerateRequest:
        """The GenerateRequest body a client posts unchanged to /inference/v1/generate.

        Without kwargs (prefill's view) the protocol requires ec_transfer_params.
        """
        return GenerateRequest(
            request_id=self.request_id, token_ids=self.token_ids,
            features=self.features(include_kwargs=include_kwargs, include_metadata=include_metadata),
            sampling_params=self.sampling_params, model=self.model, cache_salt=self.cache_salt,
            priority=self.priority, stream=self.stream, stream_options=self.stream_options,
            kv_transfer_params=self.kv_transfer_params, ec_transfer_params=ec_transfer_params,
        )
