"""Output deltas: what each step of a request's samples added, and how a whole answer gathers them.

Decode's events and the coordinator's decode chunks become `OutputDelta`s; the answer builders
(answers.py, openai_answer.py) turn them into every endpoint's answer.  No torch here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, get_args

from services.protocol.common import Usage
from services.protocol.generate import FinishReason
from services.protocol.logprobs import TokenLogprob


@dataclass(frozen=True)
class OutputDelta:
    """What one step of a request's sample added: ids, their text, and on its last one why it ended."""

    token_ids: Sequence[int] = field(default_factory=tuple)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Sequence[TokenLogprob] | None = None  # one per token id, when the request asked
    index: int = 0                                   # which sample (sampling_params.n)
    weight_version: str | None = None                # the weights that sampled these tokens, when known


def protocol_finish_reason(reason: str | None) -> FinishReason | None:
    """A finish reason as the protocol names it; anything unknown is reported as an error."""
    if not reason:
        return None
    return cast(FinishReason, reason) if reason in get_args(FinishReason) else "error"


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


class VersionSpans:
    """vLLM's weight_versions of one sample: [{"version", "start", "end"}] over its output token indexes."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.count = 0

    def add(self, version: str | None, num_tokens: int) -> None:
        if version is not None and num_tokens:
            if self.spans and self.spans[-1]["version"] == version:
                self.spans[-1]["end"] += num_tokens
            else:
                self.spans.append({"version": version, "start": self.count, "end": self.count + num_tokens})
        self.count += num_tokens

    def value(self) -> list[dict[str, Any]] | None:
        return [dict(span) for span in self.spans] or None


@dataclass
class Sample:
    """One sample's whole output, gathered from its deltas (`collect`)."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    records: list[TokenLogprob] | None = None
    last: OutputDelta | None = None
    versions: VersionSpans = field(default_factory=VersionSpans)

    def add(self, delta: OutputDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.texts.append(delta.text)
        self.versions.add(delta.weight_version, len(delta.token_ids))
        if delta.logprobs is not None:
            self.records = [*(self.records or []), *delta.logprobs]
        if delta.finish_reason:
            self.last = delta

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def gather(deltas: AsyncIterator[OutputDelta], samples: int = 1,
                 each: Callable[[OutputDelta], None] | None = None) -> list[Sample]:
    """Every sample's output (at least `samples` of them, in index order); `each(delta)` sees every delta."""
    out: dict[int, Sample] = {index: Sample() for index in range(samples)}
    async for delta in deltas:
        if each is not None:
            each(delta)
        out.setdefault(delta.index, Sample()).add(delta)
    return [out[index] for index in sorted(out)]
