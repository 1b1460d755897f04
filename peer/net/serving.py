"""A peer's gRPC server: its limits, the guard on every call, mutual TLS, and the address others dial."""

from __future__ import annotations

import socket

import grpc

from peer.config import ConfigError, PeerConfig
from peer.net.client import server_options
from peer.net.guard import Guard


def announce_host(cfg_host: str, announce: str) -> str:
    """The address other machines should dial: --announce-host, else the listen host, else this machine's name."""
    if announce:
        return announce
    if cfg_host not in ("0.0.0.0", "::", ""):
        return cfg_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def http_host(cfg_host: str, announce: str) -> str:
    """The address to print and announce for an HTTP endpoint (metrics, dashboard) listening on `cfg_host`: a
    loopback one is its own (only this machine can dial it, whatever --announce-host says)."""
    if cfg_host.startswith("127.") or cfg_host in ("::1", "localhost"):
        return cfg_host
    return announce_host(cfg_host, announce)


def grpc_server(cfg: PeerConfig, security) -> grpc.aio.Server:
    """A gRPC server with this peer's limits; with `security`, every call passes the guard (peer.net.guard)."""
    interceptors = [] if security is None else [Guard(security.gate, cfg.server.max_requests_per_peer)]
    return grpc.aio.server(options=server_options(cfg.server.max_message_bytes), interceptors=interceptors)


def listen(server: grpc.aio.Server, address: str, security) -> int:
    """Listen on `address`: mutual TLS with this peer's credential, or plaintext without `security`."""
    try:
        if security is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, security.server_credentials())
    except RuntimeError as e:  # grpcio's "Failed to bind": the port is taken, or the address is not ours
        port, reason = 0, f" ({e})"
    else:
        reason = ""
    if port == 0:
        raise ConfigError(
            f"network.port: cannot listen on {address}{reason}: in use, or not an address of this machine"
        )
    return port
