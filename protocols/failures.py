"""Why a call was refused, machine-readable: the wire contract of failures.

A peer that refuses a call sends a gRPC status code, a message for people, and one of these reasons
in the trailing metadata under REASON_KEY. Clients decide what a failure means from the reason
(and the code), never from the message. A failure without a reason did not come from a peer's
handler: the transport failed (connection refused or reset, TLS) or the deadline passed.
"""

from __future__ import annotations

import enum

REASON_KEY = "swarmtrain-reason"


class Reason(enum.StrEnum):
    BAD_INPUT = "bad_input"  # the request itself is wrong (malformed, misshapen, not finite): the caller's fault
    NOT_ADMITTED = "not_admitted"  # the caller's credential is missing, expired, revoked or not for this
    WRONG_RUN = "wrong_run"  # the request is for another run than the one this peer belongs to
    WRONG_PART = "wrong_part"  # this peer does not hold the stage, expert or state asked for
    STALE_EPOCH = "stale_epoch"  # the part is at another optimizer step than the request needs
    MISSING_INPUTS = "missing_inputs"  # a backward without inputs whose forward is no longer cached: resend them
    OVERLOADED = "overloaded"  # too many requests or bytes in flight here now: another replica, or later
    LATE = "late"  # the request's deadline passed before or while it ran: its result would be dropped
    LEAVING = "leaving"  # the peer is leaving the swarm: route elsewhere, and do not count it a fault
    STOPPING = "stopping"  # the peer is stopping because a part of it failed (a tensor-parallel rank died)
    EXPERTS_UNAVAILABLE = "experts_unavailable"  # a MoE layer's experts did not answer: not this server's fault


def reason_metadata(reason: Reason) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries `reason`."""
    return ((REASON_KEY, reason.value),)


def reason_of(error) -> Reason | None:
    """The reason a refused call carries (a grpc.aio.AioRpcError or grpc.RpcError); None when it has none."""
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # an error without metadata (raised before the call reached a peer): no reason
        return None
    for key, value in metadata:
        if key == REASON_KEY:
            try:
                return Reason(value if isinstance(value, str) else value.decode())
            except ValueError:  # a reason from a newer peer that this one does not know: treated as none
                return None
    return None
