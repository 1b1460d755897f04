"""The network side of a peer, without its model: gRPC channels and servers, TLS, relaying, metrics.

- client: channels by endpoint, every call with a deadline, large messages streamed (StageClient);
- serving: a peer's gRPC server, its guard on every call, mutual TLS, the address others dial;
- guard: who calls (its credential), may it, how much at once;
- security: this peer's credential (key, certificate from the coordinator, renewal, revocations);
- relay, uplink: carrying calls to peers that cannot be dialled, and a server's way out through a relay;
- background: an asyncio loop on a thread, for gRPC servers of processes that are not asyncio;
- metrics: Prometheus metrics of one peer, served over HTTP.

May import protocols, dht, peer.process and peer.config.
"""
