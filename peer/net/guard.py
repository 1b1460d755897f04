"""Every gRPC call a peer serves passes here first: who calls (its credential), may it, how much at once.

The TLS handshake already refused callers without a certificate of this run's authority (mutual
TLS, peer.net.security). The guard reads the caller's certificate from the call's auth context and
answers:
- UNAUTHENTICATED when it names no admitted peer of this run or has expired;
- PERMISSION_DENIED when the peer was revoked, or its roles do not allow the method;
- RESOURCE_EXHAUSTED when that peer already has `server.max_requests_per_peer` calls running.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import grpc

from dht.credential import ROLES, CredentialError, RevokedError
from dht.gate import Gate
from peer.net.refusal import Refused, refuse

logger = logging.getLogger(__name__)
# the admitted caller's peer id, for the call's task: what a handler counts per caller ("" without admission)
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("swarmtrain_caller", default="")

ANY = frozenset(ROLES)
# method name -> roles that may call it (a method not named here: any admitted peer)
ROLES_BY_METHOD = {
    "/swarmtrain.Stage/Forward": frozenset({"trainer", "coordinator"}),
    "/swarmtrain.Stage/Backward": frozenset({"trainer", "coordinator"}),
    "/swarmtrain.Expert/Forward": frozenset({"server", "trainer", "coordinator"}),
    "/swarmtrain.Expert/Backward": frozenset({"server", "trainer", "coordinator"}),
    "/swarmtrain.Stage/Round": frozenset({"server", "experts"}),
    "/swarmtrain.Expert/Round": frozenset({"server", "experts"}),
    "/swarmtrain.Stage/Progress": frozenset({"server", "experts"}),
    "/swarmtrain.Expert/Progress": frozenset({"server", "experts"}),
    "/swarmtrain.Averaging/Average": frozenset({"server", "experts"}),
    # a part's whole state: for joiners of the part and the coordinator's checkpoints, never a trainer's
    "/swarmtrain.Stage/GetState": frozenset({"server", "experts", "coordinator"}),
    "/swarmtrain.Expert/GetState": frozenset({"server", "experts", "coordinator"}),
    "/swarmtrain.Relay/Attach": frozenset({"server", "experts"}),
    "/swarmtrain.Relay/Tunnel": frozenset({"server", "experts"}),
}
# long-lived streams that carry other peers' calls: bounded by relay.max_peers and relay.max_connections
# instead of server.max_requests_per_peer
UNCOUNTED = frozenset({"/swarmtrain.Relay/Attach", "/swarmtrain.Relay/Tunnel"})


def roles_for(method: str) -> frozenset[str]:
    if method.endswith("Stream"):
        method = method[: -len("Stream")]
    return ROLES_BY_METHOD.get(method, ANY)


class Guard(grpc.aio.ServerInterceptor):
    def __init__(self, gate: Gate, max_per_peer: int):
        self.gate, self.max_per_peer = gate, max_per_peer
        self.running: dict[str, int] = {}  # peer id -> calls running (entries go at 0: bounded by live calls)
        self.denied = 0

    def admit(self, context, method: str) -> str:
        """The caller's peer id, counted as running one more call; Refused if it may not."""
        certs = context.auth_context().get("x509_pem_cert") or []
        if not certs:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "no client certificate: this peer is not admitted")
        try:
            credential = self.gate.check(certs[0])
        except CredentialError as e:
            code = grpc.StatusCode.PERMISSION_DENIED if isinstance(e, RevokedError) else grpc.StatusCode.UNAUTHENTICATED
            raise Refused(code, f"credential refused: {e}") from None
        allowed = roles_for(method)
        if not allowed.intersection(credential.roles):
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {credential.peer_id} has roles {list(credential.roles)}; {method} needs one of {sorted(allowed)}",
            )
        peer = credential.peer_id
        if method in UNCOUNTED:
            return ""
        if self.running.get(peer, 0) >= self.max_per_peer:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"peer {peer} has {self.running[peer]} calls running here (server.max_requests_per_peer)",
            )
        self.running[peer] = self.running.get(peer, 0) + 1
        return peer

    def release(self, peer: str) -> None:
        if not peer:
            return
        left = self.running.get(peer, 1) - 1
        if left > 0:
            self.running[peer] = left
        else:
            self.running.pop(peer, None)

    @contextlib.asynccontextmanager
    async def calling(self, context, method: str):
        """Around one call: admitted (or aborted with the reason), and counted while it runs."""
        try:
            peer = self.admit(context, method)
        except Refused as e:
            self.denied += 1
            logger.info("refused %s: %s", method, e.message)
            await refuse(context, e.code, e.message, e.reason)
        token = CALLER.set(peer)  # the handler's limits per caller (peer.server.servicer)
        try:
            yield
        finally:
            # a streaming handler closed from another task (its caller went away) ends in another context, where
            # the token cannot be reset; that context is the closing task's own and ends with it
            with contextlib.suppress(ValueError):
                CALLER.reset(token)
            self.release(peer)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method, guard = handler_call_details.method, self
        codecs = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary is not None or handler.stream_unary is not None:
            inner = handler.unary_unary or handler.stream_unary

            async def single(request, context):
                async with guard.calling(context, method):
                    return await inner(request, context)

            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
            return make(single, *codecs)
        inner = handler.unary_stream or handler.stream_stream

        async def streaming(request, context):
            async with guard.calling(context, method):
                result = inner(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:  # a handler that writes with context.write (grpc_health's Watch)
                    await result

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(streaming, *codecs)
