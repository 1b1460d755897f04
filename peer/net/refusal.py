"""Refusing a call with a reason (protocols.failures): every gRPC handler of a peer refuses through here."""

from __future__ import annotations

import grpc

from protocols.failures import Reason, reason_metadata

# the reason a refusal with this code carries unless the refusing handler names another
DEFAULT_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: Reason.BAD_INPUT,
    grpc.StatusCode.UNAUTHENTICATED: Reason.NOT_ADMITTED,
    grpc.StatusCode.PERMISSION_DENIED: Reason.NOT_ADMITTED,
    grpc.StatusCode.NOT_FOUND: Reason.WRONG_PART,
    grpc.StatusCode.FAILED_PRECONDITION: Reason.WRONG_PART,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.OVERLOADED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.LATE,
    grpc.StatusCode.UNAVAILABLE: Reason.STOPPING,
}


class Refused(Exception):
    """A call a handler refuses: its status code, a message for people, and its reason."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: Reason | None = None):
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason or DEFAULT_REASONS[code]


async def refuse(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, reason: Reason | None = None
) -> None:
    """End the call with `code`, `message` and its reason in the trailing metadata (raises, as abort does)."""
    await context.abort(code, message, trailing_metadata=reason_metadata(reason or DEFAULT_REASONS[code]))
