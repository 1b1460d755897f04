"""Every gRPC call a peer serves passes here first: who calls (its credential), may it, how much at once.

The TLS handshake already refused callers without a certificate of this run's authority (mutual
TLS, peer.security). The guard reads the caller's certificate from the call's auth context and
answers:
- UNAUTHENTICATED when it names no admitted peer of this run or has expired;
- PERMISSION_DENIED when the peer was revoked, or its roles do not allow the method;
- RESOURCE_EXHAUSTED when that peer already has `server.max_requests_per_peer` calls running.
"""

from __future__ import annotations

import logging

import grpc

from dht.credential import CredentialError
from dht.gate import Gate

logger = logging.getLogger(__name__)

ANY = frozenset({"server", "experts", "trainer", "coordinator"})
# method name -> roles that may call it (a method not named here: any admitted peer)
ROLES_BY_METHOD = {
    "/swarmtrain.Stage/Forward": frozenset({"trainer", "coordinator"}),
    "/swarmtrain.Stage/Backward": frozenset({"trainer", "coordinator"}),
    "/swarmtrain.Expert/Forward": frozenset({"server", "trainer", "coordinator"}),
    "/swarmtrain.Expert/Backward": frozenset({"server", "trainer", "coordinator"}),
    "/swarmtrain.Stage/Round": frozenset({"server", "experts"}),
    "/swarmtrain.Expert/Round": frozenset({"server", "experts"}),
}


def roles_for(method: str) -> frozenset[str]:
    if method.endswith("Stream"):
        method = method[: -len("Stream")]
    return ROLES_BY_METHOD.get(method, ANY)


class _Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Guard(grpc.aio.ServerInterceptor):
    def __init__(self, gate: Gate, max_per_peer: int):
        self.gate, self.max_per_peer = gate, max_per_peer
        self.running: dict[str, int] = {}  # peer id -> calls running (entries go at 0: bounded by live calls)
        self.denied = 0

    def admit(self, context, method: str) -> str:
        """The caller's peer id, counted as running one more call; _Denied if it may not."""
        certs = context.auth_context().get("x509_pem_cert") or []
        if not certs:
            raise _Denied(grpc.StatusCode.UNAUTHENTICATED, "no client certificate: this peer is not admitted")
        try:
            credential = self.gate.check(certs[0])
        except CredentialError as e:
            code = grpc.StatusCode.PERMISSION_DENIED if "revoked" in str(e) else grpc.StatusCode.UNAUTHENTICATED
            raise _Denied(code, f"credential refused: {e}") from None
        allowed = roles_for(method)
        if not allowed.intersection(credential.roles):
            raise _Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {credential.peer_id} has roles {list(credential.roles)}; {method} needs one of {sorted(allowed)}",
            )
        peer = credential.peer_id
        if self.running.get(peer, 0) >= self.max_per_peer:
            raise _Denied(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"peer {peer} has {self.running[peer]} calls running here (server.max_requests_per_peer)",
            )
        self.running[peer] = self.running.get(peer, 0) + 1
        return peer

    def release(self, peer: str) -> None:
        left = self.running.get(peer, 1) - 1
        if left > 0:
            self.running[peer] = left
        else:
            self.running.pop(peer, None)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        guard = self

        async def refuse(context, e: _Denied):
            guard.denied += 1
            logger.info("refused %s: %s", method, e.message)
            await context.abort(e.code, e.message)

        if handler.unary_unary is not None:

            async def unary_unary(request, context):
                try:
                    peer = guard.admit(context, method)
                except _Denied as e:
                    await refuse(context, e)
                try:
                    return await handler.unary_unary(request, context)
                finally:
                    guard.release(peer)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )

        def streaming(inner, kind):
            async def wrapped(request, context):
                try:
                    peer = guard.admit(context, method)
                except _Denied as e:
                    await refuse(context, e)
                try:
                    result = inner(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:  # a coroutine (stream-unary / unary-unary style)
                        yield await result
                finally:
                    guard.release(peer)

            return wrapped

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                streaming(handler.unary_stream, "unary_stream"),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                streaming(handler.stream_stream, "stream_stream"),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary is not None:

            async def stream_unary(request_iterator, context):
                try:
                    peer = guard.admit(context, method)
                except _Denied as e:
                    await refuse(context, e)
                try:
                    return await handler.stream_unary(request_iterator, context)
                finally:
                    guard.release(peer)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        return handler
