"""The one error taxonomy of epd, mapped once to HTTP status and gRPC code.

Every layer raises these; transports translate them here and nowhere else.
The OpenAI-style body is `{"error": {"message", "type", "code"}}`.  Across gRPC
an error travels as the status code plus its message, with the epd code in the
trailing metadata key `epd-error-code`, so the receiving side rebuilds the same
error (see `from_grpc`).
"""

from __future__ import annotations

from typing import Any

import grpc

ERROR_CODE_METADATA_KEY = "epd-error-code"


class EpdError(Exception):
    """Base of every error epd reports to a caller."""

    status: int = 500
    type: str = "internal_error"
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_code: str = "internal_error"

    def __init__(self, message: str, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.retry_after_s = retry_after_s

    def to_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


class InvalidRequest(EpdError):
    status, grpc_code = 400, grpc.StatusCode.INVALID_ARGUMENT
    type, default_code = "invalid_request_error", "invalid_request"


class NotFound(EpdError):
    status, grpc_code = 404, grpc.StatusCode.NOT_FOUND
    type, default_code = "not_found_error", "not_found"


class Overloaded(EpdError):
    status, grpc_code = 429, grpc.StatusCode.RESOURCE_EXHAUSTED
    type, default_code = "rate_limit_error", "overloaded"

    def __init__(self, message: str, code: str | None = None, retry_after_s: float | None = 1.0) -> None:
        # A 429 always says when to come back (Retry-After), also when rebuilt from a gRPC status.
        super().__init__(message, code, retry_after_s)


class PayloadTooLarge(EpdError):
    status, grpc_code = 413, grpc.StatusCode.INVALID_ARGUMENT
    type, default_code = "invalid_request_error", "body_too_large"


class RequestTimeout(EpdError):
    """The client did not send its request in time (not a server deadline: that is DeadlineExceeded)."""

    status, grpc_code = 408, grpc.StatusCode.INVALID_ARGUMENT
    type, default_code = "invalid_request_error", "body_timeout"


class Conflict(EpdError):
    """The request does not fit the state the server is in (another weight version, an update running)."""

    status, grpc_code = 409, grpc.StatusCode.FAILED_PRECONDITION
    type, default_code = "conflict_error", "conflict"


class Unavailable(EpdError):
    status, grpc_code = 503, grpc.StatusCode.UNAVAILABLE
    type, default_code = "service_unavailable", "unavailable"


class DeadlineExceeded(EpdError):
    status, grpc_code = 504, grpc.StatusCode.DEADLINE_EXCEEDED
    type, default_code = "timeout_error", "deadline_exceeded"


class Aborted(EpdError):
    status, grpc_code = 499, grpc.StatusCode.CANCELLED
    type, default_code = "aborted", "aborted"


class InternalError(EpdError):
    pass


_BY_GRPC = {
    cls.grpc_code: cls
    for cls in (InvalidRequest, NotFound, Overloaded, Unavailable, DeadlineExceeded, Aborted, Conflict)
}


def from_grpc(code: grpc.StatusCode, details: str | None, epd_code: str | None) -> EpdError:
    """Rebuild the error a peer raised from a gRPC status."""
    cls = _BY_GRPC.get(code, InternalError)
    if code == grpc.StatusCode.UNAVAILABLE and not epd_code:
        return Unavailable(f"upstream unavailable: {details or 'no details'}", code="upstream_unavailable")
    return cls(details or code.name.lower(), code=epd_code)


def as_epd_error(exc: BaseException) -> EpdError:
    """Any exception as an EpdError; unknown ones become a 500 without leaking internals."""
    if isinstance(exc, EpdError):
        return exc
    return InternalError(f"internal error ({type(exc).__name__})")
