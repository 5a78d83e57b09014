"""The step contract: one stage of the pipeline over a RequestContext.

A step is built with the cluster and never calls another step; it reads and
sets only its rows of the RequestContext table (context.py) and reaches its
role through the cluster's typed client (clients.py), never a transport.  A
step that does not apply (or already has its result) returns at once.  Steps
raise typed EpdErrors: the pipeline's recovery policy handles missing
entries, the HTTP entry maps the rest to a status once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from ..context import RequestContext

if TYPE_CHECKING:
    from ..cluster import Cluster


class Step(ABC):
    name: str

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    @abstractmethod
    async def execute(self, ctx: RequestContext) -> None: ...
