"""The one check that keeps weight versions apart: every stage's answer must name the request's version.

Each encode, prefill and decode answer says which weights ran it (services/weights/role.py); the request
carries the version the cluster served when it started (coordinator/weights.py).  A stage that ran other
weights fails the request (InternalError `weight_version_mixed`, counted per role): a rollout is never made
by two policies.
"""

from __future__ import annotations

from typing import Any

from services.protocol.errors import InternalError

from .context import RequestContext


def check_answer(ctx: RequestContext, role: str, answered: str, metrics: Any = None) -> None:
    """A stage answered with weights `answered` ("": a role that does not say): it must be the request's."""
    if answered and ctx.weight_version and answered != ctx.weight_version:
        if metrics is not None:
            metrics.weight_version_mixed.labels(role).inc()
        raise InternalError(f"request {ctx.label}: {role} ran weight version {answered!r}, the request runs on "
                            f"{ctx.weight_version!r}", code="weight_version_mixed")
