"""Redis failures mapped onto the connector error taxonomy, in one place."""

from __future__ import annotations

import redis

from services.connectors.base import BackendUnavailable, ConnectorError, EntryCorrupt

# Replies meaning "the server is there but will not serve now": callers may retry elsewhere or later.
_REFUSALS = ("OOM", "READONLY", "LOADING", "MASTERDOWN", "BUSY", "NOAUTH", "WRONGPASS", "MISCONF",
             "EXECABORT", "TRYAGAIN", "CLUSTERDOWN")


def classify(exc: BaseException, where: str, what: str) -> ConnectorError:
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError):
        return BackendUnavailable(f"redis at {where} unavailable during {what}: {exc}")
    message = str(exc)
    if message.startswith(_REFUSALS):
        return BackendUnavailable(f"redis at {where} refused {what}: {message}")
    if message.startswith("WRONGTYPE"):
        return EntryCorrupt(f"redis key for {what} holds another type: {message}")
    return ConnectorError(f"redis at {where} failed {what}: {message}")


