"""The step contract: one stage of the pipeline over a RequestContext.

A step that does not apply returns at once.  Steps raise typed EpdErrors;
the app maps them to HTTP once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..context import RequestContext


class Step(ABC):
    name: str

    @abstractmethod
    async def execute(self, ctx: RequestContext) -> None: ...
